/* SPDX-License-Identifier: Apache-2.0 */
/* Linked into every test program (bex_add_test): before main, a test that
 * ctest gave one CPU of its resource spec (resource "vcpus", one slot:
 * CTEST_RESOURCE_GROUP_0_VCPUS="id:N,slots:1") binds itself, and so every
 * thread and process it starts later, to CPU N. scripts/rxe-tier gives
 * ctest that spec inside the Soft-RoCE VM, so the two tests it runs side
 * by side run on a vCPU each: under qemu's TCG a wake-up from one vCPU to
 * the other costs the emulator more than twice the CPU of the same
 * ping-pong on one vCPU (docs/testing.md, "CI in the eighth session").
 * Without the spec (every native run) the variable is unset and nothing
 * changes. A value that does not parse, or a CPU the process may not use,
 * is reported on stderr and the test runs unbound. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__attribute__((constructor)) static void bex_test_vcpu_pin(void)
{
    const char *v = getenv("CTEST_RESOURCE_GROUP_0_VCPUS");
    if (!v)
        return;
    char *end;
    const char *id = strstr(v, "id:");
    long cpu = id ? strtol(id + 3, &end, 10) : -1;
    if (!id || end == id + 3 || cpu < 0 || cpu >= CPU_SETSIZE) {
        fprintf(stderr, "vcpu_pin: cannot read CTEST_RESOURCE_GROUP_0_VCPUS=\"%s\"\n", v);
        return;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((int)cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set))
        perror("vcpu_pin: sched_setaffinity");
}
