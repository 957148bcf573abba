/* SPDX-License-Identifier: Apache-2.0 */
/* Small helpers every module uses. */
#ifndef BEX_COMMON_UTIL_H
#define BEX_COMMON_UTIL_H

#include <stddef.h>

/* The struct of type type whose member member is at ptr. */
#define bex__container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

/* Elements of an array (not of a pointer). */
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

#endif
