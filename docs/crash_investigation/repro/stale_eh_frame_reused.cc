// Variant: the unmapped JIT page is mapped again and holds other bytes (new JIT code or data)
// when libgcc first classifies the stale registration.
#include <sys/mman.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
extern "C" void __register_frame(void*);
int main(int argc, char** argv) {
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  unsigned words[4] = {12, 0, 0, 0};
  memcpy(page, words, sizeof words);
  __register_frame(page);
  munmap(page, 4096);
  void* again = mmap(page, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  srand(argc > 1 ? atoi(argv[1]) : 1);
  for (int i = 0; i < 4096; ++i) static_cast<unsigned char*>(again)[i] = rand() & 0xff;
  std::printf("registered %p, unmapped, mapped again with other bytes; throwing\n", page);
  std::fflush(stdout);
  try { throw std::runtime_error("any C++ exception"); } catch (const std::exception& e) { std::printf("caught: %s\n", e.what()); }
  return 0;
}
