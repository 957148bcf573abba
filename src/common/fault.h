/* SPDX-License-Identifier: Apache-2.0 */
/* Fault injection, for tests only: a few points of the library where a test
 * can make a verbs call fail or stop a thread inside a race window, to
 * reach teardown paths that rxe never takes on its own (a failing
 * ibv_poll_cq, a post that returns a negative code, a failure that lands
 * between two steps of bex_sock_expose).
 *
 * The points exist only when BEX_FAULT_INJECT is defined, which only the
 * test library bex_fault is built with (tests/fault/CMakeLists.txt: the
 * same sources compiled again). In libbex they compile to nothing: no call,
 * no branch, no symbol.
 *
 * Each kind counts its calls (any thread). A test arms a kind with "the
 * nth call from now returns ret, with errno set to err" (ret as the verbs
 * call itself would return it: a negative count for ibv_poll_cq, a
 * positive errno, a negative one or -1 with errno for a post), and may
 * give a hook that runs, on the calling thread, when the armed call comes;
 * a pause point (EXPOSE_ARM) is nothing but its hook. */
#ifndef BEX_COMMON_FAULT_H
#define BEX_COMMON_FAULT_H

#include <stdint.h>

struct ibv_context;
struct ibv_pd;
struct ibv_td;

/* Tests: a stand-in for the provider's thread-domain verbs, as a device
 * that has them would answer (rxe has none): while set, bex__rdma_td_alloc
 * and bex__rdma_td_free call these instead of ibv_alloc_td,
 * ibv_alloc_parent_domain, ibv_dealloc_pd and ibv_dealloc_td (NULL with
 * errno set, or a verbs return code, as those do); NULL ops restores them. */
struct bex__fault_td_ops {
    struct ibv_td *(*alloc_td)(void *arg, struct ibv_context *ctx);
    struct ibv_pd *(*alloc_parent)(void *arg, struct ibv_context *ctx, struct ibv_pd *pd,
                                   struct ibv_td *td);
    int (*dealloc_pd)(void *arg, struct ibv_pd *parent);
    int (*dealloc_td)(void *arg, struct ibv_td *td);
    void *arg;
};

enum bex__fault_kind {
    BEX__FAULT_POST_SEND,  /* bex__rdma_post_send: every ibv_post_send of an engine */
    BEX__FAULT_POST_RECV,  /* bex__rdma_post_recv: every ibv_post_recv of an engine */
    BEX__FAULT_POLL_CQ,    /* bex__rdma_poll_cq, counting only polls that found
                              completions: those are lost, as on a broken CQ */
    BEX__FAULT_EXPOSE_ARM, /* bex_sock_expose: slot claimed, checks passed,
                              not yet armed (ret is ignored) */
    BEX__FAULT_QP_UP,      /* conn/setup.c: bringing the QP to RTR/RTS with the
                              peer's hello (ret: the negative errno it fails with) */
    BEX__FAULT_CUT_PREP,   /* ps/snapcut.c: a PREPARE claimed the cut, the shard's
                              lock released, the last cut's thread not joined
                              yet (ret is ignored) */
    BEX__FAULT_KINDS,
};

#ifdef BEX_FAULT_INJECT
/* The library, at a point of kind k: 0 to go on, or the value to return
 * instead (errno is set); runs the hook first if this call is the armed
 * one. Any thread. */
int bex__fault_hit(enum bex__fault_kind k);
/* Tests: arm kind k (counting from now); nth 0 disarms. The hook (may be
 * NULL) runs once, on the thread making the armed call. */
void bex__fault_arm(enum bex__fault_kind k, uint64_t nth, int ret, int err, void (*hook)(void *arg),
                    void *arg);
/* Tests: whether the armed call of kind k came (and its hook returned). */
int bex__fault_fired(enum bex__fault_kind k);
#define BEX__FAULT(k) bex__fault_hit(k)
/* Tests: fn(arg, access) runs for every registration the verbs registrar
 * (src/mem/registrar.c) makes, with the access flags it passes to
 * ibv_reg_mr, on the registering thread, before the call; fn NULL stops
 * it. The library calls bex__fault_reg_seen. */
void bex__fault_reg_hook(void (*fn)(void *arg, int access), void *arg);
void bex__fault_reg_seen(int access);
#define BEX__FAULT_REG(access) bex__fault_reg_seen(access)
void bex__fault_td_set(const struct bex__fault_td_ops *ops);
const struct bex__fault_td_ops *bex__fault_td(void);
#define BEX__FAULT_TD() bex__fault_td()
#else
#define BEX__FAULT(k)          0
#define BEX__FAULT_REG(access) ((void)0)
#define BEX__FAULT_TD()        ((const struct bex__fault_td_ops *)0)
#endif

#endif
