/* SPDX-License-Identifier: Apache-2.0 */
/* Shared secret: key files, the environment, the derived key. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "bex/sock.h"
#include "sock/secret.h"

int bex_secret_load(const char *path, void *buf, size_t cap, size_t *len)
{
    if (!path || !buf || !len)
        return -EINVAL;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return -errno;
    int err = 0;
    struct stat st;
    if (fstat(fd, &st)) {
        err = -errno;
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        err = -EINVAL;
        goto out;
    }
    /* a key others can read is no longer a secret; one they can write is
     * theirs to choose */
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
        err = -EPERM;
        goto out;
    }
    uint8_t tmp[BEX_SECRET_MAX + 3]; /* room for a trailing CR LF and one more */
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd, tmp + n, sizeof tmp - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            err = -errno;
            goto wipe;
        }
        if (r == 0)
            break;
        n += (size_t)r;
        if (n == sizeof tmp)
            break;
    }
    if (n > 0 && tmp[n - 1] == '\n') {
        n--;
        if (n > 0 && tmp[n - 1] == '\r')
            n--;
    }
    if (n > BEX_SECRET_MAX || n > cap) {
        err = -EFBIG;
        goto wipe;
    }
    if (n < BEX_SECRET_MIN) {
        err = -EINVAL;
        goto wipe;
    }
    memcpy(buf, tmp, n);
    *len = n;
wipe:
    sodium_memzero(tmp, sizeof tmp);
out:
    close(fd);
    return err;
}

int bex__secret_resolve(const void *secret, size_t len, uint8_t key[BEX__AUTH_KEY_LEN])
{
    if (secret) {
        int err = bex__auth_key(secret, len, key);
        return err ? err : 1;
    }
    if (len)
        return -EINVAL;
    const char *env = getenv("BEX_SECRET");
    if (env && env[0]) {
        int err = bex__auth_key(env, strlen(env), key);
        return err ? err : 1;
    }
    const char *file = getenv("BEX_SECRET_FILE");
    if (!file || !file[0])
        return 0;
    uint8_t buf[BEX_SECRET_MAX];
    size_t n = 0;
    int err = bex_secret_load(file, buf, sizeof buf, &n);
    if (!err)
        err = bex__auth_key(buf, n, key);
    sodium_memzero(buf, sizeof buf);
    return err ? err : 1;
}
