// The int8 product at batch 8 alone (one thread, widening path): blocks of 4 weight rows x 4 batch
// rows (the step's) against 2 x 8 and 3 x 8. g++ -O3 -ffp-contract=fast -mavx512f -mavx2 -mfma -mtune=native.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
using namespace std;
static double now(){return chrono::duration<double>(chrono::steady_clock::now().time_since_epoch()).count();}
#define PIN(x) asm("" : "+v"(x))
static inline __m512 wv(const int8_t* p){ return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
// NR rows x NB batch rows, K multiple of 16; y[b*N + r]
template<int NR,int NB> void blk(const int8_t* W,int N,int K,const float* x,float* y){
  for(int r=0;r<N;r+=NR) for(int b0=0;b0<8;b0+=NB){
    __m512 acc[NR][NB]; for(int i=0;i<NR;i++)for(int b=0;b<NB;b++)acc[i][b]=_mm512_setzero_ps();
    for(int k=0;k<K;k+=16){
      __m512 xv[NB]; for(int b=0;b<NB;b++){xv[b]=_mm512_loadu_ps(x+(b0+b)*K+k);PIN(xv[b]);}
      for(int i=0;i<NR;i++){ __m512 w=wv(W+(size_t)(r+i)*K+k); PIN(w); for(int b=0;b<NB;b++) acc[i][b]=_mm512_fmadd_ps(w,xv[b],acc[i][b]); }
    }
    for(int i=0;i<NR;i++)for(int b=0;b<NB;b++) y[(b0+b)*N+r+i]=_mm512_reduce_add_ps(acc[i][b]);
  }
}
int main(){
  int shapes[][2]={{32000,256},{1024,256},{256,512}};
  for(auto& sh:shapes){int N=sh[0],K=sh[1];
    vector<int8_t> W((size_t)N*K); vector<float> x(8*K), y(8*N), y2(8*N);
    for(auto& w:W) w=rand()%255-127; for(auto& v:x) v=rand()/(float)RAND_MAX;
    int reps=max(1,50000000/(N*K)); double b1=1e9,b2=1e9,b3=1e9;
    for(int t=0;t<15;t++){
      double t0=now(); for(int i=0;i<reps;i++) blk<4,4>(W.data(),N,K,x.data(),y.data()); b1=min(b1,(now()-t0)/reps);
      t0=now(); for(int i=0;i<reps;i++) blk<2,8>(W.data(),N,K,x.data(),y2.data()); b2=min(b2,(now()-t0)/reps);
      t0=now(); for(int i=0;i<reps;i++) blk<3,8>(W.data(),N,K,x.data(),y2.data()); b3=min(b3,(now()-t0)/reps);
    }
    printf("%5dx%4d B8: 4x4 %.1f Gw-b/s, 2x8 %.1f (%.2fx), 3x8 %.1f (%.2fx)\n",N,K,8.0*N*K/b1/1e9,8.0*N*K/b2/1e9,b1/b2,8.0*N*K/b3/1e9,b1/b3);
  }
}
