// Issue rates of one core, from registers: zmm and ymm FMA, zmm vpdpbusd, and the widening pair
// (vcvtdq2ps, vpmovsxbd). g++ -O2.
#include <chrono>
#include <cstdio>
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
int main(){
  const long n=300000000;
  double t0=now();
  asm volatile(
    "vxorps %%zmm0,%%zmm0,%%zmm0\n vxorps %%zmm1,%%zmm1,%%zmm1\n vxorps %%zmm2,%%zmm2,%%zmm2\n vxorps %%zmm3,%%zmm3,%%zmm3\n"
    "vxorps %%zmm4,%%zmm4,%%zmm4\n vxorps %%zmm5,%%zmm5,%%zmm5\n vxorps %%zmm6,%%zmm6,%%zmm6\n vxorps %%zmm7,%%zmm7,%%zmm7\n"
    "mov %0, %%rcx\n1:\n"
    "vfmadd231ps %%zmm8,%%zmm9,%%zmm0\n vfmadd231ps %%zmm8,%%zmm9,%%zmm1\n vfmadd231ps %%zmm8,%%zmm9,%%zmm2\n vfmadd231ps %%zmm8,%%zmm9,%%zmm3\n"
    "vfmadd231ps %%zmm8,%%zmm9,%%zmm4\n vfmadd231ps %%zmm8,%%zmm9,%%zmm5\n vfmadd231ps %%zmm8,%%zmm9,%%zmm6\n vfmadd231ps %%zmm8,%%zmm9,%%zmm7\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
  double t=now()-t0; printf("zmm FMA: %.2f G/s (%.1f GFLOP/s)\n", 8*n/t/1e9, 8*n*32/t/1e9);
  t0=now();
  asm volatile(
    "mov %0, %%rcx\n1:\n"
    "vfmadd231ps %%ymm8,%%ymm9,%%ymm0\n vfmadd231ps %%ymm8,%%ymm9,%%ymm1\n vfmadd231ps %%ymm8,%%ymm9,%%ymm2\n vfmadd231ps %%ymm8,%%ymm9,%%ymm3\n"
    "vfmadd231ps %%ymm8,%%ymm9,%%ymm4\n vfmadd231ps %%ymm8,%%ymm9,%%ymm5\n vfmadd231ps %%ymm8,%%ymm9,%%ymm6\n vfmadd231ps %%ymm8,%%ymm9,%%ymm7\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
  t=now()-t0; printf("ymm FMA: %.2f G/s (%.1f GFLOP/s)\n", 8*n/t/1e9, 8*n*16/t/1e9);
  t0=now();
  asm volatile(
    "mov %0, %%rcx\n1:\n"
    "vpdpbusd %%zmm8,%%zmm9,%%zmm0\n vpdpbusd %%zmm8,%%zmm9,%%zmm1\n vpdpbusd %%zmm8,%%zmm9,%%zmm2\n vpdpbusd %%zmm8,%%zmm9,%%zmm3\n"
    "vpdpbusd %%zmm8,%%zmm9,%%zmm4\n vpdpbusd %%zmm8,%%zmm9,%%zmm5\n vpdpbusd %%zmm8,%%zmm9,%%zmm6\n vpdpbusd %%zmm8,%%zmm9,%%zmm7\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
  t=now()-t0; printf("zmm vpdpbusd: %.2f G/s (%.1f G int8 MAC/s)\n", 8*n/t/1e9, 8*n*64/t/1e9);
  t0=now();
  asm volatile(
    "mov %0, %%rcx\n1:\n"
    "vcvtdq2ps %%zmm8,%%zmm0\n vcvtdq2ps %%zmm8,%%zmm1\n vcvtdq2ps %%zmm8,%%zmm2\n vcvtdq2ps %%zmm8,%%zmm3\n"
    "vpmovsxbd %%xmm9,%%zmm4\n vpmovsxbd %%xmm9,%%zmm5\n vpmovsxbd %%xmm9,%%zmm6\n vpmovsxbd %%xmm9,%%zmm7\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
  t=now()-t0; printf("4 cvt + 4 pmovsx zmm: %.2f G pairs/s\n", 4*n/t/1e9);
}
