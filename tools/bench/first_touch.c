// First-touch cost of the ways expert bytes can reach memory (BENCHMARKS.md, "First touch").
// Usage: first_touch MODE FILE MIB   (drop the page cache before each run; the kernel time is what matters)
//   anon        O_DIRECT reads of 4 MiB into a fresh anonymous mapping (the slab as it was)
//   anonpop     the same, each range populated first with MADV_POPULATE_WRITE (the slab today)
//   thp         the same as anon, the mapping advised MADV_HUGEPAGE
//   map         a read-only shared mapping of FILE, each 4 MiB populated with MADV_POPULATE_READ
//   maphuge     the same, the mapping advised MADV_HUGEPAGE (the store's page-cache mode)
//   mapadv      map, each range announced with POSIX_FADV_WILLNEED first
// Prints wall time and the process's user and kernel CPU seconds.
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s anon|anonpop|thp|map|maphuge|mapadv FILE MIB\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    size_t len = (size_t)atol(argv[3]) << 20, chunk = 4 << 20;
    double t0 = now();
    unsigned long sum = 0;
    char *p;
    if (strncmp(mode, "map", 3) != 0) {
        int fd = open(argv[2], O_RDONLY | O_DIRECT);
        p = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (fd < 0 || p == MAP_FAILED) return perror("open/mmap"), 1;
        if (!strcmp(mode, "thp")) madvise(p, len, MADV_HUGEPAGE);
        for (size_t o = 0; o < len; o += chunk) {
            if (!strcmp(mode, "anonpop")) madvise(p + o, chunk, MADV_POPULATE_WRITE);
            if (pread(fd, p + o, chunk, o) != (ssize_t)chunk) return perror("pread"), 1;
        }
    } else {
        int fd = open(argv[2], O_RDONLY);
        p = mmap(0, len, PROT_READ, MAP_SHARED, fd, 0);
        if (fd < 0 || p == MAP_FAILED) return perror("open/mmap"), 1;
        if (!strcmp(mode, "maphuge")) madvise(p, len, MADV_HUGEPAGE);
        for (size_t o = 0; o < len; o += chunk) {
            if (!strcmp(mode, "mapadv")) posix_fadvise(fd, o, chunk, POSIX_FADV_WILLNEED);
            if (madvise(p + o, chunk, MADV_POPULATE_READ)) return perror("MADV_POPULATE_READ"), 1;
        }
    }
    for (size_t o = 0; o < len; o += 4096) sum += p[o];
    double wall = now() - t0;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("%s: wall %.2f s (%.2f GB/s), user %.2f s, kernel %.2f s (checksum %lu)\n", mode, wall,
           len / 1e9 / wall, ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6,
           ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6, sum);
    return 0;
}
