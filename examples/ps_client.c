/* SPDX-License-Identifier: Apache-2.0 */
/* ps_client: train a few embedding rows on a running parameter server.
 * It shows include/bex/ps.h and include/bex/dir.h: a directory that says
 * where the shards are (a cluster file), a PS client over it, and one
 * step of training: Fetch rows, Push gradients, Fetch again and check
 * that the server applied SGD (w -= lr * grad).
 *
 *   cat > cluster.json <<'JSON'
 *   {"services": {"ps": {"shards": [
 *       {"replicas": [{"addr": "127.0.0.1:7000", "transport": "tcp"}]}]}}}
 *   JSON
 *   bex-ps --cluster cluster.json --shard all --table 1:4:sgd:0.5 &
 *   # ... until it prints "bex-ps: ready"
 *   ./ps_client cluster.json           # prints the rows, then "update ok"
 *
 * The table (id 1, 4 floats a row, SGD, learning rate 0.5) must be the
 * one bex-ps serves. LOCAL_IP (a 2nd argument, default 127.0.0.1) is this
 * host's address, the one bex binds its connections to. Exit status 0, or
 * 1 with the reason on stderr. */
#include <arpa/inet.h>
#include <math.h>
#include <stdio.h>

#include "example_args.h"
#include <bex/dir.h>
#include <bex/ps.h>

#define TABLE 1
#define DIM   4
#define LR    0.5f
#define NKEYS 3

static void print_rows(const char *what, const uint64_t *keys, const float *rows)
{
    for (int i = 0; i < NKEYS; i++) {
        printf("%s key %llu:", what, (unsigned long long)keys[i]);
        for (int c = 0; c < DIM; c++)
            printf(" %+.4f", rows[i * DIM + c]);
        printf("\n");
    }
}

/* One training step on keys: fetch, push a gradient, fetch, check. */
static int train_step(bex_ps_client *pc)
{
    /* Keys are any 64-bit ids (a feature's hash, say); they spread over
     * the shards, and a request to several shards goes out in parallel. */
    const uint64_t keys[NKEYS] = {42, 1000, 77777};
    float before[NKEYS * DIM], grads[NKEYS * DIM], after[NKEYS * DIM];
    /* A row the server has never seen starts at small random values. */
    int rc = bex_ps_fetch_sync(pc, TABLE, DIM, keys, NKEYS, before);
    if (rc)
        return rc;
    print_rows("fetched", keys, before);
    for (int i = 0; i < NKEYS * DIM; i++)
        grads[i] = 0.1f * (float)(i + 1); /* what a backward pass would give */
    /* A Push is applied once on every replica of its shards, also when
     * it is retried after a lost answer. */
    if ((rc = bex_ps_push_sync(pc, TABLE, DIM, keys, NKEYS, grads)) != 0 ||
        (rc = bex_ps_fetch_sync(pc, TABLE, DIM, keys, NKEYS, after)) != 0)
        return rc;
    print_rows("updated", keys, after);
    for (int i = 0; i < NKEYS * DIM; i++)
        if (fabsf(after[i] - (before[i] - LR * grads[i])) > 1e-4f) {
            fprintf(stderr,
                    "ps_client: row %d column %d: %f, expected %f (is bex-ps's table "
                    "1:%d:sgd:%g?)\n",
                    i / DIM, i % DIM, after[i], before[i] - LR * grads[i], DIM, LR);
            return -EPROTO;
        }
    printf("update ok: w -= %g * grad on %d rows\n", LR, NKEYS);
    return 0;
}

int main(int argc, char **argv)
{
    example_args(argc, argv, "ps_client", "CLUSTER_FILE [LOCAL_IP]");
    bex_ctx_config cfg = {.size = sizeof(bex_ctx_config),
                          .transport = BEX_TRANSPORT_TCP}; /* TCP: runs anywhere */
    if ((argc != 2 && argc != 3) ||
        bex_addr_resolve(argc == 3 ? argv[2] : "127.0.0.1", 0, &cfg.local_addr, NULL, 0) != 0) {
        fprintf(stderr, "usage: ps_client CLUSTER_FILE [LOCAL_IP]\n");
        return 2;
    }
    /* The directory: which replicas serve which shard of service "ps". */
    bex_dir *dir = NULL;
    char err[256] = "";
    int rc = bex_dir_create(NULL, &dir);
    if (rc == 0 && (rc = bex_dir_load_file(dir, argv[1], err, sizeof err)) != 0) {
        if (err[0]) /* what is wrong, and where in the file */
            fprintf(stderr, "ps_client: %s\n", err);
        else
            fprintf(stderr, "ps_client: %s: %s\n", argv[1], bex_strerror(rc));
        bex_dir_destroy(dir);
        return 1;
    }
    bex_ctx *ctx = NULL;
    bex_ps_client *pc = NULL;
    bex_ps_client_config pcc = {
        .size = sizeof(bex_ps_client_config), .dir = dir, .service = "ps", .timeout_ms = 5000};
    if (rc == 0 && (rc = bex_ctx_create(&cfg, &ctx)) == 0 &&
        (rc = bex_ps_client_create(ctx, &pcc, &pc)) == 0)
        rc = train_step(pc);
    if (rc)
        fprintf(stderr, "ps_client: %s\n", bex_strerror(rc));
    if (pc)
        bex_ps_client_destroy(pc); /* before its context and directory */
    if (ctx)
        bex_ctx_destroy(ctx);
    bex_dir_destroy(dir); /* NULL is fine */
    return rc ? 1 : 0;
}
