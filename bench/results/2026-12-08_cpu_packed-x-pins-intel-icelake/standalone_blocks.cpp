// The bf16 block of the step written in intrinsics, standalone: 4 rows x 4 batch rows twice, 2 x 8,
// 3 x 8 and 1 x 8, over 64 rows of 256 weights held in L1, x read by each multiply-add.
// g++ -O3 -march=icelake-server -o blocks standalone_blocks.cpp && ./blocks (G multiply-adds/s, one thread)
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
template<int NR, int NB>
__attribute__((noinline)) void blk(const uint32_t* W, long K, const float* xt, float* y){
  __m512 acc[NR][NB]; for(int i=0;i<NR;i++)for(int b=0;b<NB;b++) acc[i][b]=_mm512_setzero_ps();
  const __m512i mask=_mm512_set1_epi32(0xFFFF0000);
  for(long c=0;c<K;c+=32){
    __m512i l[NR];
    for(int i=0;i<NR;i++) l[i]=_mm512_loadu_si512(W+i*(K/2)+c/2);
    for(int j=0;j<2;j++){
      for(int i=0;i<NR;i++){
        __m512 w = j? _mm512_castsi512_ps(_mm512_and_si512(l[i],mask)) : _mm512_castsi512_ps(_mm512_slli_epi32(l[i],16));
        for(int b=0;b<NB;b++) acc[i][b]=_mm512_fmadd_ps(_mm512_loadu_ps(xt+b*K+c+16*j),w,acc[i][b]);
      }
    }
  }
  for(int i=0;i<NR;i++)for(int b=0;b<NB;b++) y[b*NR+i]=_mm512_reduce_add_ps(acc[i][b]);
}
int main(){
  long K=256; int N=64;
  uint32_t* W=(uint32_t*)aligned_alloc(64,N*K*2); for(long i=0;i<N*K/2;i++) W[i]=0x3f803f80;
  float* x=(float*)aligned_alloc(64,8*K*4); for(int i=0;i<8*K;i++) x[i]=0.001f*i;
  float y[64*8];
  for(int t=0;t<3;t++){
    long R=20000; double t0,dt;
    t0=now(); for(long r=0;r<R;r++) for(int n=0;n<N;n+=4){ blk<4,4>(W+n*K/2,K,x,y); blk<4,4>(W+n*K/2,K,x+4*K,y+16);} dt=now()-t0;
    printf("4x4 twice %.1f  ", R*(double)N*K*8/dt/1e9);
    t0=now(); for(long r=0;r<R;r++) for(int n=0;n<N;n+=2){ blk<2,8>(W+n*K/2,K,x,y);} dt=now()-t0;
    printf("2x8 %.1f  ", R*(double)N*K*8/dt/1e9);
    t0=now(); for(long r=0;r<R;r++) for(int n=0;n<N;n+=3){ if(n+3<=N) blk<3,8>(W+n*K/2,K,x,y);} dt=now()-t0;
    printf("3x8 %.1f  ", R*(double)(N/3*3)*K*8/dt/1e9);
    t0=now(); for(long r=0;r<R;r++) for(int n=0;n<N;n+=1){ blk<1,8>(W+n*K/2,K,x,y);} dt=now()-t0;
    printf("1x8 %.1f G MAC/s\n", R*(double)N*K*8/dt/1e9);
  }
}
