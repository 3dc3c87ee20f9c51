// LD_PRELOAD shim: log every __register_frame / __deregister_frame call (pointer, first word),
// forward to libgcc_s. Used to check whether XLA:CPU frees JIT memory whose .eh_frame is still
// registered with libgcc's unwinder.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <execinfo.h>

// Live registrations (begin pointers not yet deregistered).
#define MAX_LIVE 65536
static void *live[MAX_LIVE];
static int n_live;
static long n_leaks;
static void add_live(void *p) { if (n_live < MAX_LIVE) live[n_live++] = p; }
static int remove_live(void *p) {
  for (int i = n_live - 1; i >= 0; --i) if (live[i] == p) { live[i] = live[--n_live]; return 1; }
  return 0;
}

static FILE *out;
static void *gcc_sym(const char *name) {
  static void *lib;
  if (!lib) lib = dlopen("libgcc_s.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) lib = dlopen("libgcc_s.so.1", RTLD_NOW);
  void *f = dlvsym(lib, name, "GCC_3.0");
  if (!f) { fprintf(stderr, "ehtrack: no %s in libgcc_s\n", name); abort(); }
  return f;
}
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void open_log(void) {
  if (!out) {
    const char *p = getenv("EHTRACK_LOG");
    char path[4096];
    // One file per process: children (subprocess tests, redis-server) inherit LD_PRELOAD.
    snprintf(path, sizeof path, "%s.%d", p ? p : "/tmp/ehtrack.log", (int)getpid());
    out = fopen(path, "a");
    setvbuf(out, NULL, _IOLBF, 0);
  }
}
void __register_frame(void *begin) {
  static void (*real)(void *);
  if (!real) real = gcc_sym("__register_frame");
  pthread_mutex_lock(&mu); open_log();
  fprintf(out, "R %p %u tid=%ld\n", begin, begin ? *(uint32_t *)begin : 0, (long)syscall(SYS_gettid));
  pthread_mutex_unlock(&mu);
  add_live(begin);
  real(begin);
}
void __deregister_frame(void *begin) {
  static void (*real)(void *);
  if (!real) real = gcc_sym("__deregister_frame");
  pthread_mutex_lock(&mu); open_log();
  int found = remove_live(begin);
  fprintf(out, "D %p tid=%ld%s\n", begin, (long)syscall(SYS_gettid), found ? "" : " NOT-REGISTERED");
  pthread_mutex_unlock(&mu);
  real(begin);
}

int munmap(void *addr, size_t len) {
  static int (*real)(void *, size_t);
  if (!real) real = dlsym(RTLD_NEXT, "munmap");
  pthread_mutex_lock(&mu);
  for (int i = 0; i < n_live; ++i) {
    char *p = live[i];
    if (p >= (char *)addr && p < (char *)addr + len) {
      open_log();
      ++n_leaks;
      fprintf(out, "LEAK munmap(%p, %zu) frees registered eh_frame %p tid=%ld (leak #%ld)\n", addr, len, p,
              (long)syscall(SYS_gettid), n_leaks);
      // backtrace() walks libgcc's FDE lists and so changes what a later crash would see: opt-in.
      if (getenv("EHTRACK_BACKTRACE")) {
        void *frames[32]; int n = backtrace(frames, 32);
        fflush(out); backtrace_symbols_fd(frames, n, fileno(out));
      }
    }
  }
  pthread_mutex_unlock(&mu);
  return real(addr, len);
}
long ehtrack_leaks(void) { return n_leaks; }
int ehtrack_live(void) { return n_live; }

void ehtrack_note(const char *text) {
  pthread_mutex_lock(&mu); open_log();
  fprintf(out, "T %s live=%d leaks=%ld\n", text, n_live, n_leaks);
  pthread_mutex_unlock(&mu);
}
