/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory: its contents (services, shards and replicas) and
 * their replacement. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "bex/sock.h"
#include "common/log.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "rpc/dir_impl.h"

/* ---- contents ---- */

void bex__dir_services_free(struct service *s)
{
    while (s) {
        struct service *next = s->next;
        for (uint32_t i = 0; i < s->n_shards; i++)
            free(s->shards[i].reps);
        free(s->shards);
        free(s->name);
        free(s);
        s = next;
    }
}

static struct service *service_find(struct service *list, const char *name)
{
    for (struct service *s = list; s; s = s->next)
        if (!strcmp(s->name, name))
            return s;
    return NULL;
}

struct shard *bex__dir_shard_find(bex_dir *d, const char *service, uint32_t shard)
{
    struct service *s = service_find(d->services, service);
    return s && shard < s->n_shards ? &s->shards[shard] : NULL;
}

int bex__dir_set_members(bex_dir *d, const struct bex__dir_member *m, size_t n)
{
    struct service *list = NULL;
    int err = -ENOMEM;
    pthread_mutex_lock(&d->mu);
    /* shape first: services and their shard counts */
    for (size_t i = 0; i < n; i++) {
        struct service *s = service_find(list, m[i].service);
        if (!s) {
            if (!(s = calloc(1, sizeof(*s))) || !(s->name = strdup(m[i].service))) {
                free(s);
                goto err_free;
            }
            s->next = list;
            list = s;
        }
        if (m[i].shard >= s->n_shards) {
            struct shard *ns = realloc(s->shards, (m[i].shard + 1) * sizeof(*ns));
            if (!ns)
                goto err_free;
            memset(ns + s->n_shards, 0, (m[i].shard + 1 - s->n_shards) * sizeof(*ns));
            s->shards = ns;
            s->n_shards = m[i].shard + 1;
        }
    }
    for (size_t i = 0; i < n; i++) {
        struct shard *sh = &service_find(list, m[i].service)->shards[m[i].shard];
        struct bex__dir_node *node;
        if ((err = bex__dir_node_get(d, &m[i].r, &node)))
            goto err_free;
        bool dup = false;
        for (size_t k = 0; k < sh->n; k++)
            dup |= sh->reps[k] == node;
        if (dup)
            continue;
        struct bex__dir_node **nr = realloc(sh->reps, (sh->n + 1) * sizeof(*nr));
        if (!nr) {
            err = -ENOMEM;
            goto err_free;
        }
        sh->reps = nr;
        sh->reps[sh->n++] = node;
    }
    bex__dir_services_free(d->services);
    d->services = list;
    d->generation++;
    pthread_mutex_unlock(&d->mu);
    return 0;

err_free:
    /* nodes made on the way stay (empty of shards): harmless */
    bex__dir_services_free(list);
    pthread_mutex_unlock(&d->mu);
    return err;
}
