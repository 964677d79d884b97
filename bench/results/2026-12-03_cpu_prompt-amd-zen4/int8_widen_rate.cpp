#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <vector>
#include <cstdlib>
typedef float vec __attribute__((vector_size(64)));
static inline vec load(const float* p){vec v; std::memcpy(&v,p,64); return v;}
static inline vec wload(const int8_t* p){ return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
#define PIN(x) asm("" : "+v"(x))
template<int NR>
__attribute__((noinline)) void rows(const int8_t* W, int64_t N, int64_t K, const float* x, float* y){
  for(int64_t r=0;r<N;r+=NR){
    vec acc[NR]={};
    for(int64_t k=0;k<K;k+=16){
      vec xv=load(x+k); PIN(xv);
      for(int i=0;i<NR;++i){ vec w=wload(W+(r+i)*K+k); PIN(w); acc[i]+=w*xv; }
    }
    for(int i=0;i<NR;++i){ float s=0; for(int l=0;l<16;++l) s+=acc[i][l]; y[r+i]=s; }
  }
}
int main(int argc,char**argv){
  int64_t K=256;
  for(int64_t N : {64L, 2048L, 49152L}){
    std::vector<int8_t> W(N*K); for(auto&w:W) w=rand()%255-127;
    std::vector<float> x(K,1.0f), y(N);
    int reps = (int)(400000000L/(N*K));
    for(int v=0; v<2; ++v){
      auto t0=std::chrono::steady_clock::now();
      for(int r=0;r<reps;++r){ if(v==0) rows<4>(W.data(),N,K,x.data(),y.data()); else rows<8>(W.data(),N,K,x.data(),y.data()); }
      double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
      printf("N=%ld (%.1f MB) NR=%d: %.2f G weights/s\n", N, N*K/1e6, v?8:4, reps*(double)N*K/s/1e9);
    }
  }
}
