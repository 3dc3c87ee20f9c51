// Minimal model of the suspected failure: register an .eh_frame with libgcc's unwinder,
// unmap its memory without __deregister_frame, then throw a C++ exception. libgcc classifies
// "unseen" registered objects lazily, at the first FDE lookup after registration, so the throw
// reads the stale pointer.
#include <sys/mman.h>
#include <cstdio>
#include <cstring>
#include <stdexcept>
extern "C" void __register_frame(void*);
int main() {
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  unsigned words[4] = {12, 0, 0, 0};  // a nonzero length, so __register_frame keeps it
  memcpy(page, words, sizeof words);
  __register_frame(page);
  munmap(page, 4096);  // the JIT memory goes away; the registration stays
  std::printf("registered %p and unmapped it; throwing\n", page);
  std::fflush(stdout);
  try { throw std::runtime_error("any C++ exception"); } catch (const std::exception& e) { std::printf("caught: %s\n", e.what()); }
  return 0;
}
