/* SPDX-License-Identifier: Apache-2.0 */
/* Rendezvous generations over the fake transport: a rendezvous slot is
 * named by its index and a generation that changes each time the slot is
 * reused, so that a WRITE_WITH_IMM or an answer meant for an earlier use
 * of a slot is refused (the engine fails with -EPROTO) instead of
 * completing the transfer that holds the slot now. The stale immediate
 * and answer are replayed by the harness as the peer (fk_inject_*). */
#include <errno.h>

#include "fake/fake.h"
#include "harness.h"

static void config(struct bex__engine_config *c)
{
    fk_default_config(c);
    c->eager_max = 1024; /* 8 KiB goes by rendezvous */
}

/* Slot reused: the immediate of its first transfer arrives while the
 * second one holds it (granted, buffer allocated, not yet written). */
static int stale_write_generation(void)
{
    struct bex__engine_config c;
    config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 1);
    struct fk_stream *st = fk_open(&p);
    struct fk_msg *m1 = fk_send(&p, st, 8192, false);
    fk_quiesce(&p);
    CHECK_EQ(m1->delivered, 1);
    CHECK_EQ(p.s[1].n_grants, 1);
    uint32_t imm1 = p.s[1].grants[0].imm;

    p.s[0].hold_writes = true; /* the second transfer's data stays on the wire */
    struct fk_msg *m2 = fk_send(&p, st, 8192, false);
    fk_quiesce(&p);
    CHECK(!m2->arrived);
    uint32_t imm2 = 0;
    for (uint32_t i = 0; i < p.s[1].n_grants; i++)
        if (p.s[1].grants[i].used)
            imm2 = p.s[1].grants[i].imm;
    /* the same slot, another generation */
    CHECK_EQ(imm2 & 0xffff, imm1 & 0xffff);
    CHECK(imm2 != imm1);

    fk_inject_write_imm(&p, 1, imm1);
    CHECK(fk_recv_cqe(&p, 1));
    CHECK(fk_dead(&p, 1));
    CHECK_EQ(p.s[1].fail_err, -EPROTO);
    CHECK_EQ(m2->delivered, 0);
    /* the sender's WRITEs meet a destroyed QP: it fails too */
    p.s[0].hold_writes = false;
    fk_quiesce(&p);
    CHECK(fk_dead(&p, 0));
    CHECK_EQ(m2->status, -EIO); /* its last WRITE was posted, never completed */
    fk_pair_fini(&p);
    return 0;
}

/* An immediate naming a slot past the table, or a slot never granted. */
static int stale_write_index(void)
{
    for (int k = 0; k < 2; k++) {
        struct bex__engine_config c;
        config(&c);
        struct fk_pair p;
        fk_pair_init(&p, &c, &c, 2);
        struct fk_stream *st = fk_open(&p);
        struct fk_msg *m1 = fk_send(&p, st, 8192, false);
        fk_quiesce(&p);
        CHECK_EQ(m1->delivered, 1);
        uint32_t imm1 = p.s[1].grants[0].imm;
        /* past the table (rndv_max 16), or slot 3, never granted, with the
         * generation it has until its first use (0) */
        uint32_t imm = k == 0 ? (imm1 & 0xffff0000u) | c.rndv_max : 3;
        fk_inject_write_imm(&p, 1, imm);
        CHECK(fk_recv_cqe(&p, 1));
        CHECK(fk_dead(&p, 1));
        CHECK_EQ(p.s[1].fail_err, -EPROTO);
        fk_pair_fini(&p);
    }
    return 0;
}

/* The sender's request slot reused: an answer to its first request arrives
 * while the second one waits for its own. */
static int stale_resp_generation(void)
{
    struct bex__engine_config c;
    config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 3);
    struct fk_stream *st = fk_open(&p);
    struct fk_msg *m1 = fk_send(&p, st, 8192, false);
    fk_quiesce(&p);
    CHECK_EQ(m1->delivered, 1);
    uint32_t id1 = p.s[0].last_req_id;
    uint64_t addr1 = p.s[1].grants[0].addr;
    uint32_t imm1 = p.s[1].grants[0].imm;

    struct fk_msg *m2 = fk_send(&p, st, 8192, false);
    fk_progress(&p, 0);
    while (fk_exec(&p, 0)) /* the request reaches the peer, unanswered */
        ;
    uint32_t id2 = p.s[0].last_req_id;
    CHECK_EQ(id2 & 0xffff, id1 & 0xffff);
    CHECK(id2 != id1);

    struct bex__hdr h = {
        .type = BEX__MSG_RNDV_RESP, .stream = imm1, .id = id1, .addr = addr1, .rkey = 0};
    fk_inject_hdr(&p, 0, &h);
    CHECK(fk_recv_cqe(&p, 0));
    CHECK(fk_dead(&p, 0));
    CHECK_EQ(p.s[0].fail_err, -EPROTO);
    CHECK(!m2->final_posted);
    CHECK_EQ(m2->status, -ECANCELED); /* nothing of it was written */
    fk_pair_fini(&p);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(stale_write_generation), BEX_CASE(stale_write_index),
              BEX_CASE(stale_resp_generation))
