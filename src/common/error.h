/* SPDX-License-Identifier: Apache-2.0 */
/* The text behind bex_last_error(), set where a call refuses its caller's
 * arguments. */
#ifndef BEX_COMMON_ERROR_H
#define BEX_COMMON_ERROR_H

/* Record why (printf-style, one line) for bex_last_error() on this thread;
 * returns err, so that a refusal reads "return bex__refuse(-EINVAL, ...)". */
int bex__refuse(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
