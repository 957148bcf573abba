/* SPDX-License-Identifier: Apache-2.0 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "bex/common.h"
#include "common/error.h"

/* The codes bex gives a meaning of its own (docs/protocol.md): the
 * system's text first (what the code is called elsewhere), then bex's. */
static const struct {
    int err;
    const char *text;
} bex_codes[] = {
    {EIO, "Input/output error (bex: in doubt: the connection failed after the message or call "
          "left; it may have reached the peer)"},
    {ECANCELED, "Operation canceled (bex: not sent: the message or call never left, or the "
                "request was cancelled)"},
    {ESTALE, "Stale file handle (bex: stale: an id older than the server's retry horizon, its "
             "outcome unknown, or a copy that is gone)"},
    {EAGAIN, "Resource temporarily unavailable (bex: refused for now, nothing applied: a full "
             "table of clients, a rate limit, or a shard catching up; retry later)"},
    {EBUSY, "Device or resource busy (bex: the server asked for a retry; nothing applied)"},
    {EPROTO, "Protocol error (bex: the peer broke the protocol, or is not bex)"},
    {EPROTONOSUPPORT, "Protocol not supported (bex: no common transport: RDMA only here, the "
                      "peer has no RDMA)"},
    {EBADMSG, "Bad message (bex: a malformed message from the peer)"},
    {EACCES, "Permission denied (bex: authentication failed: a wrong secret, or only one side "
             "has one)"},
    {ETIMEDOUT, "Connection timed out (bex: a deadline passed: the call's, the connection's "
                "setup, keepalive or a stall)"},
    {ECONNRESET, "Connection reset by peer (bex: the peer closed the socket or its connection "
                 "was lost)"},
    {EMSGSIZE, "Message too long (bex: larger than the peer's max_msg)"},
    {E2BIG, "Argument list too long (bex: past the wire's bounds, e.g. BEX_PS_BODY_MAX)"},
    {ENOSPC, "No space left on device (bex: a table's max_rows reached)"},
    {ENODEV, "No such device (bex: no usable RDMA device for this address)"},
    {ENOSYS, "Function not implemented (bex: the server has no such method)"},
    {EDEADLK, "Resource deadlock avoided (bex: a blocking call from a callback of its own "
              "context; nothing done)"},
    {EPIPE, "Broken pipe (bex: the socket is closed)"},
};

const char *bex_strerror(int err)
{
    if (err == 0)
        return "success";
    if (err > 0)
        err = -err;
    for (size_t i = 0; i < sizeof bex_codes / sizeof bex_codes[0]; i++)
        if (bex_codes[i].err == -err)
            return bex_codes[i].text;
    /* strerrordesc_np is thread-safe and returns static text. */
    const char *s = strerrordesc_np(-err);
    return s ? s : "unknown error";
}

static _Thread_local char last_error[256];

const char *bex_last_error(void)
{
    return last_error;
}

int bex__refuse(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return err;
}
