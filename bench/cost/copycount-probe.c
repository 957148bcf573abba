/* SPDX-License-Identifier: Apache-2.0 */
/* copycount-probe: copies COUNT x SIZE bytes through memcpy and memmove
 * (half each), called through pointers the compiler cannot inline, so
 * that tests/bench/test_cost.sh can check bex-copycount's totals against
 * a known answer.   usage: copycount-probe COUNT SIZE */
#include <stdlib.h>
#include <string.h>

typedef void *(*copy_fn)(void *, const void *, size_t);
static copy_fn volatile copy_a = memcpy, copy_b = memmove;

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    long count = atol(argv[1]);
    size_t size = strtoul(argv[2], NULL, 0);
    char *src = calloc(1, size + 1), *dst = calloc(1, size + 1);
    if (!src || !dst)
        return 1;
    for (long i = 0; i < count; i++)
        (i & 1 ? copy_b : copy_a)(dst, src, size);
    free(src);
    free(dst);
    return 0;
}
