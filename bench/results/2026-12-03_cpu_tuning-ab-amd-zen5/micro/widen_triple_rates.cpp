// The widening path's triple (vpmovsxbd, vcvtdq2ps, FMA per 16 int8 weights) from registers and from
// L1, and two variants of it. g++ -O2.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
alignas(64) int8_t buf[1<<16];
int main(){
  const long n=100000000;
  double t0=now();
  asm volatile(
    "mov %0, %%rcx\n1:\n"
    "vpmovsxbd %%xmm9,%%zmm4\n vcvtdq2ps %%zmm4,%%zmm4\n vfmadd231ps %%zmm4,%%zmm8,%%zmm0\n"
    "vpmovsxbd %%xmm9,%%zmm5\n vcvtdq2ps %%zmm5,%%zmm5\n vfmadd231ps %%zmm5,%%zmm8,%%zmm1\n"
    "vpmovsxbd %%xmm9,%%zmm6\n vcvtdq2ps %%zmm6,%%zmm6\n vfmadd231ps %%zmm6,%%zmm8,%%zmm2\n"
    "vpmovsxbd %%xmm9,%%zmm7\n vcvtdq2ps %%zmm7,%%zmm7\n vfmadd231ps %%zmm7,%%zmm8,%%zmm3\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
  double t=now()-t0; printf("reg: widen+cvt+fma: %.2f G triples/s = %.1f Gw/s\n", 4*n/t/1e9, 4*n*16/t/1e9);
  t0=now();
  asm volatile(
    "mov %0, %%rcx\n mov %1, %%rdx\n1:\n"
    "vpmovsxbd (%%rdx),%%zmm4\n vcvtdq2ps %%zmm4,%%zmm4\n vfmadd231ps %%zmm4,%%zmm8,%%zmm0\n"
    "vpmovsxbd 16(%%rdx),%%zmm5\n vcvtdq2ps %%zmm5,%%zmm5\n vfmadd231ps %%zmm5,%%zmm8,%%zmm1\n"
    "vpmovsxbd 32(%%rdx),%%zmm6\n vcvtdq2ps %%zmm6,%%zmm6\n vfmadd231ps %%zmm6,%%zmm8,%%zmm2\n"
    "vpmovsxbd 48(%%rdx),%%zmm7\n vcvtdq2ps %%zmm7,%%zmm7\n vfmadd231ps %%zmm7,%%zmm8,%%zmm3\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n), "r"(buf) : "rcx","rdx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
  t=now()-t0; printf("L1 mem: widen+cvt+fma: %.2f G triples/s = %.1f Gw/s\n", 4*n/t/1e9, 4*n*16/t/1e9);
  t0=now();
  asm volatile(
    "mov %0, %%rcx\n mov %1, %%rdx\n1:\n"
    "vmovdqu64 (%%rdx),%%zmm10\n"
    "vpmovsxbd %%xmm10,%%zmm4\n vcvtdq2ps %%zmm4,%%zmm4\n vfmadd231ps %%zmm4,%%zmm8,%%zmm0\n"
    "vextracti32x4 $1,%%zmm10,%%xmm11\n vpmovsxbd %%xmm11,%%zmm5\n vcvtdq2ps %%zmm5,%%zmm5\n vfmadd231ps %%zmm5,%%zmm8,%%zmm1\n"
    "vextracti32x4 $2,%%zmm10,%%xmm12\n vpmovsxbd %%xmm12,%%zmm6\n vcvtdq2ps %%zmm6,%%zmm6\n vfmadd231ps %%zmm6,%%zmm8,%%zmm2\n"
    "vextracti32x4 $3,%%zmm10,%%xmm13\n vpmovsxbd %%xmm13,%%zmm7\n vcvtdq2ps %%zmm7,%%zmm7\n vfmadd231ps %%zmm7,%%zmm8,%%zmm3\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n), "r"(buf) : "rcx","rdx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm10","xmm11","xmm12","xmm13");
  t=now()-t0; printf("L1 mem, extract: %.2f G triples/s = %.1f Gw/s\n", 4*n/t/1e9, 4*n*16/t/1e9);
  // magic-number conversion: vpmovsxbd; vpaddd magic; vsubps magic; fma
  t0=now();
  asm volatile(
    "mov %0, %%rcx\n mov %1, %%rdx\n1:\n"
    "vpmovsxbd (%%rdx),%%zmm4\n vpaddd %%zmm14,%%zmm4,%%zmm4\n vsubps %%zmm15,%%zmm4,%%zmm4\n vfmadd231ps %%zmm4,%%zmm8,%%zmm0\n"
    "vpmovsxbd 16(%%rdx),%%zmm5\n vpaddd %%zmm14,%%zmm5,%%zmm5\n vsubps %%zmm15,%%zmm5,%%zmm5\n vfmadd231ps %%zmm5,%%zmm8,%%zmm1\n"
    "vpmovsxbd 32(%%rdx),%%zmm6\n vpaddd %%zmm14,%%zmm6,%%zmm6\n vsubps %%zmm15,%%zmm6,%%zmm6\n vfmadd231ps %%zmm6,%%zmm8,%%zmm2\n"
    "vpmovsxbd 48(%%rdx),%%zmm7\n vpaddd %%zmm14,%%zmm7,%%zmm7\n vsubps %%zmm15,%%zmm7,%%zmm7\n vfmadd231ps %%zmm7,%%zmm8,%%zmm3\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n), "r"(buf) : "rcx","rdx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
  t=now()-t0; printf("L1 mem magic: %.2f G quads/s = %.1f Gw/s\n", 4*n/t/1e9, 4*n*16/t/1e9);
}
