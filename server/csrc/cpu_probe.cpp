// What this CPU offers and what the OS lets us use: raw CPUID words, XCR0 (read with XGETBV) and, for AMX,
// whether Linux granted this process the tile-data state (arch_prctl ARCH_REQ_XCOMP_PERM). Decoded in
// server/cpu_features.py. Built without -march flags (it must run on any x86-64 CPU, and it decides
// which -march flags the kernels get). Sources: Intel SDM vol. 2A (CPUID leaves 1 and 7, XGETBV) and
// vol. 1 ch. 13 (XSAVE state components); Linux Documentation/arch/x86/xstate.rst (AMX permission).
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define KI_X86 1
#else
#define KI_X86 0
#endif

extern "C" {

int32_t kubeinfer_cpu_probe_abi() { return 1; }

// out[0] leaf 1 ECX, out[1] leaf 1 EDX, out[2..4] leaf 7.0 EBX/ECX/EDX, out[5] leaf 7.1 EAX,
// out[6] XCR0 low 32 bits, out[7] XCR0 high 32 bits, out[8] AMX permission: 1 granted, 0 refused or
// not Linux, -1 not asked (no AMX tile in CPUID or no tile state in XCR0).
// Returns 1 on x86-64, 0 elsewhere (out all zero).
int32_t kubeinfer_cpu_probe(uint32_t* out) {
  for (int i = 0; i < 9; ++i) out[i] = 0;
#if KI_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf >= 1 && __get_cpuid(1, &a, &b, &c, &d)) {
    out[0] = c;
    out[1] = d;
  }
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    out[2] = b;
    out[3] = c;
    out[4] = d;
    const unsigned sub_max = a;
    if (sub_max >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      out[5] = a;
    }
  }
  // XGETBV faults unless the OS set CR4.OSXSAVE (CPUID.1:ECX bit 27).
  if (out[0] & (1u << 27)) {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    out[6] = lo;
    out[7] = hi;
  }
  const bool amx_cpuid = out[4] & (1u << 24);
  const bool amx_xcr0 = (out[6] & (3u << 17)) == (3u << 17);
  if (!amx_cpuid || !amx_xcr0) {
    out[8] = static_cast<uint32_t>(-1);
  } else {
#if defined(__linux__)
    // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the first tile instruction
    // raises SIGILL even where CPUID and XCR0 list AMX (Linux 5.16+; older kernels refuse the call).
    out[8] = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0;
#else
    out[8] = 0;
#endif
  }
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
