/* SPDX-License-Identifier: Apache-2.0 */
/* Replay runner: feeds every file of the given corpus directories (or the
 * given files) through the target's LLVMFuzzerTestOneInput, in name order.
 * Built with the normal compiler in every build, so that CTest (label unit)
 * replays the committed corpus in plain and sanitizer builds alike; a
 * failed invariant aborts, which fails the test. An empty corpus fails too:
 * a replay that ran nothing proves nothing. */
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    for (;;) {
        if (!buf)
            break;
        if (n == cap) {
            uint8_t *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0)
            break;
    }
    fclose(f);
    if (!buf) {
        fprintf(stderr, "replay: %s: out of memory\n", path);
        return -1;
    }
    /* an exact-size copy, so that ASan sees a read past the input's end */
    uint8_t *in = malloc(n ? n : 1);
    if (!in) {
        free(buf);
        return -1;
    }
    memcpy(in, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(in, n);
    free(in);
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Returns the number of inputs run, or -1. */
static long run_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "replay: %s: %s\n", dir, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **nn = realloc(names, cap * sizeof(*names));
            if (!nn)
                break;
            names = nn;
        }
        size_t len = strlen(dir) + strlen(de->d_name) + 2;
        names[n] = malloc(len);
        if (!names[n])
            break;
        snprintf(names[n], len, "%s/%s", dir, de->d_name);
        n++;
    }
    closedir(d);
    qsort(names, n, sizeof(*names), cmp_str);
    long ran = 0;
    for (size_t i = 0; i < n; i++) {
        struct stat st;
        if (stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
            if (run_file(names[i]) < 0)
                ran = -1;
            else if (ran >= 0)
                ran++;
        }
        free(names[i]);
    }
    free(names);
    return ran;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
        return 2;
    }
    long total = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
            return 1;
        }
        long n = S_ISDIR(st.st_mode) ? run_dir(argv[i]) : (run_file(argv[i]) < 0 ? -1 : 1);
        if (n < 0)
            return 1;
        printf("replay: %ld input(s) from %s\n", n, argv[i]);
        total += n;
    }
    if (total == 0) {
        fprintf(stderr, "replay: no inputs: an empty corpus proves nothing\n");
        return 1;
    }
    return 0;
}
