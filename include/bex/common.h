/* bex: shared definitions for every module.
 *
 * Errors are values: functions return 0 on success or a negative errno
 * (-ENOMEM, -ETIMEDOUT, ...). Constructors hand objects back through an
 * out-parameter. */
#ifndef BEX_COMMON_H
#define BEX_COMMON_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Text for a bex return code (a negative errno, or 0). Never NULL; the string
 * is static and may be used from any thread. */
const char *bex_strerror(int err);

#ifdef __cplusplus
}
#endif
#endif
