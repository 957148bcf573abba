/* The engine's upcall table (src/transport/transport.h) for a test that
 * drives a transport directly and names its upcalls up_on_<upcall>, as
 * every such test does: the initializers, once, so that an upcall added to
 * the table is added here rather than in each test.
 *
 *     static const struct bex__transport_upcalls ops = {BEX_TEST_UP_ON};
 *
 * A test with more (direct_buf) adds them after it. */
#ifndef BEX_TEST_UPCALLS_H
#define BEX_TEST_UPCALLS_H

#define BEX_TEST_UP_ON                                                                             \
    .on_up = up_on_up, .on_msg = up_on_msg, .on_open = up_on_open,                                 \
    .on_peer_close = up_on_peer_close, .on_send_done = up_on_send_done,                            \
    .on_stream_closed = up_on_stream_closed, .on_direct = up_on_direct, .on_fail = up_on_fail

#endif
