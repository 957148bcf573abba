/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: hashing (keys to slots and shards). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "bex/ps.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "ps/shard_internal.h"

/* ---- hashing ---- */

uint64_t bex__ps_mix(uint64_t x)
{
    return bex__ps_mix_inline(x);
}

float bex_ps_init_value(uint32_t table, uint64_t key, uint32_t col, float s)
{
    uint64_t h = bex__ps_mix(bex__ps_mix(((uint64_t)table << 32) | col) ^ key);
    /* the top 24 bits: exact in a float */
    float u = (float)(h >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
    return (2.0f * u - 1.0f) * s;
}

uint32_t bex_ps_key_shard(uint64_t key, uint32_t n_shards)
{
    if (n_shards <= 1)
        return 0;
    return bex__ps_key_shard_n(key, n_shards);
}
