/* SPDX-License-Identifier: Apache-2.0 */
/* The receive budget against rendezvous grants over the fake transport
 * (issue 23 item 5, RDMA side): a granted destination holds
 * recv_bytes_max until its WRITE_WITH_IMM, so a peer that is granted and
 * never writes held it for good, and a few peers could take all of it.
 *
 * - grant_no_progress: the sender's writes stay on the wire: the grant
 *   must fail the receiving engine (-ETIMEDOUT) once it is older than
 *   rate_window_ms + len / min_rate, and not before.
 * - paced_sender: grants written one at a time, each within that time of
 *   the previous delivery but the later ones long after their grant: the
 *   engine must not fail (the deadline counts from the last delivery).
 * - share: two engines of one context; while the first holds a grant, the
 *   second gets no second destination beyond its share of recv_max, though
 *   the context has room; it gets it once the first delivered. */
#include <errno.h>
#include <stdlib.h>

#include "fake/fake.h"
#include "harness.h"

#define KIB 1024u

static void config(struct bex__engine_config *c)
{
    fk_default_config(c);
    c->max_msg = 1u << 20;
    c->min_rate = 256 * KIB; /* 512 KiB: 2 s */
    c->rate_window_ms = 1000;
}

static int grant_no_progress(void)
{
    struct bex__engine_config c;
    config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 1);
    struct fk_stream *st = fk_open(&p);
    p.s[0].hold_writes = true; /* the peer is granted and never writes */
    struct fk_msg *m = fk_send(&p, st, 512 * KIB, false);
    fk_quiesce(&p);
    CHECK_EQ(p.s[1].n_grants, 1);
    CHECK(!m->arrived);
    fk_tick(&p, 1, 0);
    fk_tick(&p, 1, 2800); /* within 1 s + 2 s */
    CHECK(!fk_dead(&p, 1));
    fk_tick(&p, 1, 400);
    CHECK(fk_dead(&p, 1));
    CHECK_EQ(p.s[1].fail_err, -ETIMEDOUT);
    CHECK_EQ(m->delivered, 0);
    fk_pair_fini(&p);
    return 0;
}

static int paced_sender(void)
{
    struct bex__engine_config c;
    config(&c);
    c.rndv_ahead = 4;
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 2);
    struct fk_stream *st = fk_open(&p);
    p.s[0].hold_writes = true;
    struct fk_msg *m[4];
    for (int k = 0; k < 4; k++)
        m[k] = fk_send(&p, st, 512 * KIB, false);
    fk_quiesce(&p);
    CHECK(p.s[1].n_grants >= 2);
    fk_tick(&p, 1, 0);
    for (int k = 0; k < 4; k++) {
        fk_tick(&p, 1, 2500); /* each within 3 s of the last delivery */
        CHECK(!fk_dead(&p, 1));
        p.s[0].hold_writes = false;
        /* its writes, no further (the sender's completions free its queue) */
        while (!m[k]->arrived && (fk_exec(&p, 0) || fk_send_cqe(&p, 0) || fk_progress(&p, 0)))
            ;
        CHECK(m[k]->arrived);
        p.s[0].hold_writes = true;
        fk_quiesce(&p);
        CHECK_EQ(m[k]->delivered, 1);
    }
    CHECK(!fk_dead(&p, 1));
    fk_pair_fini(&p);
    return 0;
}

static struct fk_pair pa, pb;

static int share(void)
{
    struct bex__engine_config c;
    config(&c);
    c.rndv_bytes_max = 64u << 20;
    c.share_min = 64 * KIB;
    static struct bex__recv_acct acct; /* one context: both receivers count here */
    fk_pair_init(&pa, &c, &c, 3);
    fk_pair_init(&pb, &c, &c, 4);
    struct fk_side *ra = &pa.s[1], *rb = &pb.s[1];
    ra->sh.recv_acct = rb->sh.recv_acct = &acct;
    ra->sh.recv_max = rb->sh.recv_max = 3 * 1024 * KIB; /* 3 MiB: shares of 1 MiB */
    struct fk_stream *sa = fk_open(&pa), *sb = fk_open(&pb);
    pa.s[0].hold_writes = pb.s[0].hold_writes = true;
    struct fk_msg *ma = fk_send(&pa, sa, 768 * KIB, false);
    fk_quiesce(&pa);
    fk_tick(&pa, 1, 0);
    CHECK_EQ(ra->n_grants, 1);
    /* b: its first fits its share (3 MiB / 3), the second does not, though
     * 1.5 MiB of the context's 3 are free */
    struct fk_msg *mb1 = fk_send(&pb, sb, 768 * KIB, false);
    struct fk_msg *mb2 = fk_send(&pb, sb, 768 * KIB, false);
    fk_quiesce(&pb);
    fk_tick(&pb, 1, 0);
    fk_quiesce(&pb);
    uint32_t used = 0;
    for (uint32_t i = 0; i < rb->n_grants; i++)
        used += rb->grants[i].used;
    CHECK_EQ(used, 1);
    /* a delivers: b's second is granted at b's next tick */
    pa.s[0].hold_writes = false;
    fk_quiesce(&pa);
    CHECK_EQ(ma->delivered, 1);
    fk_tick(&pa, 1, 0);
    fk_tick(&pb, 1, 0);
    pb.s[0].hold_writes = false;
    fk_quiesce(&pb);
    CHECK_EQ(mb1->delivered, 1);
    CHECK_EQ(mb2->delivered, 1);
    CHECK(!fk_dead(&pa, 1) && !fk_dead(&pb, 1));
    fk_pair_fini(&pa);
    fk_pair_fini(&pb);
    CHECK_EQ(atomic_load(&acct.holders), 0);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(grant_no_progress), BEX_CASE(paced_sender), BEX_CASE(share))
