/* SPDX-License-Identifier: Apache-2.0 */
/* Blocking I/O of setup messages with a deadline (tests, tools). */
#ifndef BEX_CONN_HELLO_IO_H
#define BEX_CONN_HELLO_IO_H

#include <stddef.h>
#include <stdint.h>

#include "wire/hello.h"

/* ---- blocking I/O with a deadline ------------------------------------ */

/* CLOCK_MONOTONIC now, in milliseconds. */
int64_t bex__hello_now_ms(void);

/* Write / read exactly len bytes on fd before the absolute monotonic time
 * deadline_ms (from bex__hello_now_ms() + timeout). Works on blocking and
 * non-blocking fds; never raises SIGPIPE on sockets. Returns 0, -ETIMEDOUT,
 * -ECONNRESET when the peer closed (EOF) before len bytes, or the errno of
 * poll/recv/send. A silent peer therefore costs at most the deadline. */
int bex__hello_write_all(int fd, const void *buf, size_t len, int64_t deadline_ms);
int bex__hello_read_all(int fd, void *buf, size_t len, int64_t deadline_ms);

/* Encode + write, and read + decode, one hello. recv returns the decoder's
 * errors as well as the I/O errors. */
int bex__hello_send(int fd, const struct bex__hello *h, int64_t deadline_ms);
int bex__hello_recv(int fd, struct bex__hello *out, int64_t deadline_ms);

/* Send our readiness status (0 or a positive errno); receive the peer's.
 * ready_recv returns 0 and sets *status (0 = peer ready), -EBADMSG for a
 * malformed notice, or an I/O error. */
int bex__hello_ready_send(int fd, uint32_t status, int64_t deadline_ms);
int bex__hello_ready_recv(int fd, uint32_t *status, int64_t deadline_ms);

#endif
