/* SPDX-License-Identifier: Apache-2.0 */
/* What the RPC objects share: the guard (calls in progress, closed, the
 * process that made it), addresses and the context's configuration. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <bex/sock.h>

#include "bexmod.h"

/* The process id, kept here: getpid() is a system call in glibc >= 2.25,
 * and the fork check of every call made one that the C client does not
 * (python/tests/test_ps_syscalls.py). fork() runs the child handler in the
 * child before anything else, so a fork's check sees the child's id. */
static volatile pid_t cur_pid;

static void pid_after_fork(void)
{
    cur_pid = getpid();
}

int bexmod_pid_init(void)
{
    cur_pid = getpid();
    return pthread_atfork(NULL, NULL, pid_after_fork) ? -1 : 0;
}

pid_t bexmod_pid(void)
{
    return cur_pid;
}

void bexmod_guard_init(struct bexmod_guard *g)
{
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->idle, NULL);
    g->pid = bexmod_pid();
}

void bexmod_guard_fini(struct bexmod_guard *g)
{
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->idle);
}

int bexmod_guard_enter(struct bexmod_guard *g, const char *what)
{
    if (g->pid != bexmod_pid()) {
        PyErr_Format(bexmod_fork_error,
                     "this bex %s belongs to process %d, and this process (%d) is a fork of it: "
                     "open a new one here",
                     what, (int)g->pid, (int)bexmod_pid());
        return -1;
    }
    pthread_mutex_lock(&g->mu);
    int closed = g->closed;
    if (!closed)
        g->busy++;
    pthread_mutex_unlock(&g->mu);
    if (closed) {
        PyErr_Format(PyExc_ValueError, "bex %s is closed", what);
        return -1;
    }
    return 0;
}

void bexmod_guard_leave(struct bexmod_guard *g)
{
    pthread_mutex_lock(&g->mu);
    if (--g->busy == 0)
        pthread_cond_broadcast(&g->idle);
    pthread_mutex_unlock(&g->mu);
}

int bexmod_guard_close(struct bexmod_guard *g)
{
    pthread_mutex_lock(&g->mu);
    g->closed = 1;
    pthread_mutex_unlock(&g->mu);
    return g->pid == bexmod_pid() ? 0 : -1;
}

void bexmod_guard_wait_idle(struct bexmod_guard *g)
{
    pthread_mutex_lock(&g->mu);
    while (g->busy)
        pthread_cond_wait(&g->idle, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

int bexmod_parse_addr(const char *s, bex_addr *out)
{
    char why[200];
    if (bex_addr_resolve(s, 0, out, why, sizeof why) || !strchr(s, ':')) {
        PyErr_Format(PyExc_ValueError,
                     "address must be 'ip:port', '[v6]:port' or 'host:port', not '%s'", s);
        return -1;
    }
    return 0;
}

int bexmod_ctx_config(bex_ctx_config *cc, const char *local, const char *transport)
{
    if (bex_addr_resolve(local, 0, &cc->local_addr, NULL, 0) != 0) {
        PyErr_Format(PyExc_ValueError, "local_addr must be an IP address or host, not '%s'", local);
        return -1;
    }
    if (!strcmp(transport, "tcp"))
        cc->transport = BEX_TRANSPORT_TCP;
    else if (!strcmp(transport, "rdma"))
        cc->transport = BEX_TRANSPORT_RDMA;
    else if (!strcmp(transport, "auto"))
        cc->transport = BEX_TRANSPORT_AUTO;
    else {
        PyErr_Format(PyExc_ValueError, "transport must be 'tcp', 'rdma' or 'auto', not '%s'",
                     transport);
        return -1;
    }
    return 0;
}

void bexmod_set_attr_steal(PyObject *o, const char *name, PyObject *v)
{
    if (v)
        PyObject_SetAttrString(o, name, v);
    Py_XDECREF(v);
}
