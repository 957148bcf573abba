/* SPDX-License-Identifier: Apache-2.0 */
/* A shard's consistent cut (src/ps/snapcut.c) against a stop that lands
 * inside PREPARE, one process, no peer, the library built with its fault
 * points (this program links bex_fault). The pause point
 * BEX__FAULT_CUT_PREP stops PREPARE where it has claimed the cut and
 * released the shard's lock (to join the last cut's thread).
 *
 *   stop_in_prepare  bex__ps_cut_stop (the first half of the shard's
 *                    destroy) runs in that window: the PREPARE is refused
 *                    -ECANCELED and holds nothing, and so is a later one;
 *                    the destroy then returns. (It once undid the stop:
 *                    the PREPARE answered 0 and held Pushes for the
 *                    cut's whole pause.)
 *   abort_in_prepare the coordinator's ABORT of that cut (its PREPARE took
 *                    too long) lands there: the PREPARE is refused
 *                    -ETIMEDOUT (the cut is void) and holds nothing; the
 *                    next PREPARE is taken. (The ABORT was lost: the cut
 *                    held Pushes for its whole pause.) */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bex/ps.h"
#include "bex/rpc.h"
#include "common/fault.h"
#include "harness.h"
#include "ps/ps_internal.h"
#include "ps/shard_internal.h"

static const bex_ps_table_config TI = {.id = 1, .dim = 2, .optimizer = BEX_PS_SGD, .lr = 1.0f};

static bex_ctx *g_ctx;
static bex_ps_shard *g_s;

/* op of cut id, straight to the shard's Cut handler (no request: not
 * COMMIT). */
static int cut_op(uint8_t op, uint64_t id)
{
    uint8_t b[BEX__PS_CUT_HDR_LEN];
    bex__ps_cut_put(b, &(struct bex__ps_cut_hdr){.op = op, .id = id});
    void *resp = NULL;
    size_t len = 0;
    int rc = bex__ps_cut_serve(g_s, g_ctx, b, sizeof b, NULL, &resp, &len);
    bex_rpc_free(resp);
    return rc;
}

static void stop_now(void *arg)
{
    (void)arg;
    bex__ps_cut_stop(g_s);
}

static void abort_now(void *arg)
{
    (void)arg;
    CHECK_OK(cut_op(BEX__PS_CUT_ABORT, 7));
}

/* A context and a shard whose cuts hold long (a cut that went on would
 * hold until the destroy). */
static int rig_up(char *dir)
{
    bex_ctx_config cc = {.transport = BEX_TRANSPORT_TCP};
    bex_addr_parse("127.0.0.1", 0, &cc.local_addr);
    CHECK_OK(bex_ctx_create(&cc, &g_ctx));
    CHECK(mkdtemp(dir));
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = 1,
                              .tables = &TI,
                              .n_tables = 1,
                              .cut_dir = dir,
                              .cut_pause_ms = 60000};
    CHECK_OK(bex_ps_shard_create(&pc, &g_s));
    return 0;
}

static int rig_down(const char *dir)
{
    bex_ps_shard_destroy(g_s); /* returns: nothing left waiting */
    CHECK_OK(bex_ctx_destroy(g_ctx));
    CHECK_OK(rmdir(dir)); /* no file written */
    return 0;
}

static int t_stop_in_prepare(void)
{
    char dir[] = "/tmp/bex-cut-XXXXXX";
    CHECK_OK(rig_up(dir));
    bex__fault_arm(BEX__FAULT_CUT_PREP, 1, 0, 0, stop_now, NULL);
    CHECK_EQ(cut_op(BEX__PS_CUT_PREPARE, 7), -ECANCELED);
    CHECK(bex__fault_fired(BEX__FAULT_CUT_PREP));
    CHECK_EQ(cut_op(BEX__PS_CUT_PREPARE, 8), -ECANCELED); /* the shard is going */
    return rig_down(dir);
}

static int t_abort_in_prepare(void)
{
    char dir[] = "/tmp/bex-cut-XXXXXX";
    CHECK_OK(rig_up(dir));
    bex__fault_arm(BEX__FAULT_CUT_PREP, 1, 0, 0, abort_now, NULL);
    CHECK_EQ(cut_op(BEX__PS_CUT_PREPARE, 7), -ETIMEDOUT);
    CHECK(bex__fault_fired(BEX__FAULT_CUT_PREP));
    /* nothing held: the next cut is taken (no cut began, so no interval
     * applies), then aborted */
    CHECK_OK(cut_op(BEX__PS_CUT_PREPARE, 9));
    CHECK_OK(cut_op(BEX__PS_CUT_ABORT, 9));
    return rig_down(dir);
}

BEX_TEST_MAIN({"stop_in_prepare", t_stop_in_prepare}, {"abort_in_prepare", t_abort_in_prepare})
