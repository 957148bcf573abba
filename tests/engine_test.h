/* SPDX-License-Identifier: Apache-2.0 */
/* Scaffolding of the tests that drive an engine directly, without the
 * sock layer (tests/fake, test_srq_reuse, test_hdrfree, fakenet,
 * fuzz_engine). */
#ifndef BEX_TEST_ENGINE_H
#define BEX_TEST_ENGINE_H

#include "transport/rdma/engine.h"

/* The engine's upcall table (src/transport/transport.h) for a test that
 * names its upcalls up_on_<upcall>, as every such test does: the
 * initializers, once, so that an upcall added to the table is added here
 * rather than in each test.
 *
 *     static const struct bex__transport_upcalls ops = {BEX_TEST_UP_ON};
 *
 * A test with more (direct_buf) adds them after it. */
#define BEX_TEST_UP_ON                                                                             \
    .on_up = up_on_up, .on_msg = up_on_msg, .on_open = up_on_open,                                 \
    .on_peer_close = up_on_peer_close, .on_send_done = up_on_send_done,                            \
    .on_stream_closed = up_on_stream_closed, .on_direct = up_on_direct, .on_fail = up_on_fail

/* Engine settings for a test without a device: small queues, a keepalive
 * that never times a peer out within a case, no rendezvous or credit
 * timeout. */
static inline struct bex__engine_config bex_test_engine_config(void)
{
    return (struct bex__engine_config){
        .sq_depth = 32,
        .rq_depth = 16,
        .eager_max = 1024,
        .frag_size = 4096,
        .send_window = 0,
        .rndv_ahead = 2,
        .keepalive_ms = 1000,
        .keepalive_timeout_ms = 3600000,
        .max_msg = 1u << 20,
        .rndv_max = 16,
        .rndv_bytes_max = 16u << 20,
        .rndv_timeout_ms = 0,
        .credit_timeout_ms = 0,
    };
}

#endif
