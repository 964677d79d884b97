// The int8 product alone, one thread, one batch row: the widening path (vpmovsxbd, vcvtdq2ps, FMA
// per 16 weights) against x in four byte planes through vpdpbusd, as the step would run it (see
// README.md). Built with: g++ -O3 -mavx512f -mavx512bw -mavx2 -mfma -mtune=native. The planes'
// lane-wise joining before the reduction is exact only for K <= 256 (the step used it only there);
// the 64 x 8192 row here times the loop, its result is not checked against overflow.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <algorithm>
using namespace std;
static double now(){return chrono::duration<double>(chrono::steady_clock::now().time_since_epoch()).count();}
#define PIN(x) asm("" : "+v"(x))
void widen(const int8_t* W,const float* sc,int N,int K,const float* x,float* y){
  for(int r=0;r<N;r+=4){
    __m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
    for(int k=0;k<K;k+=16){
      __m512 xv=_mm512_loadu_ps(x+k); PIN(xv);
      a0=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(W+(r+0)*K+k)))),xv,a0);
      a1=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(W+(r+1)*K+k)))),xv,a1);
      a2=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(W+(r+2)*K+k)))),xv,a2);
      a3=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(W+(r+3)*K+k)))),xv,a3);
    }
    y[r]=_mm512_reduce_add_ps(a0)*sc[r];y[r+1]=_mm512_reduce_add_ps(a1)*sc[r+1];
    y[r+2]=_mm512_reduce_add_ps(a2)*sc[r+2];y[r+3]=_mm512_reduce_add_ps(a3)*sc[r+3];
  }
}
struct Planes { vector<uint8_t> p; int K; int E; int64_t topsum; };  // p: 4 planes of K bytes
void split(const float* x,int K,Planes& s){
  float m=0; for(int k=0;k<K;k++) m=max(m,fabsf(x[k]));
  int e; frexpf(m,&e); s.E=30-e+1-1; // m < 2^e -> m*2^E < 2^30
  s.E = 30 - e; s.K=K; s.p.assign(4*K,0); s.topsum=0;
  for(int k=0;k<K;k++){ int32_t v=(int32_t)lrint(ldexpf(x[k],s.E)); uint32_t u=(uint32_t)v;
    for(int p=0;p<4;p++) s.p[p*K+k]=(u>>(8*p))&255; s.topsum+=(int8_t)s.p[3*K+k]; }
}
// int32 sums of 4 vectors, in one xmm
static inline __m128i hsum4i(__m512i a,__m512i b,__m512i c,__m512i d){
  __m512i ab=_mm512_add_epi32(_mm512_shuffle_i32x4(a,b,0x44),_mm512_shuffle_i32x4(a,b,0xEE));
  __m512i cd=_mm512_add_epi32(_mm512_shuffle_i32x4(c,d,0x44),_mm512_shuffle_i32x4(c,d,0xEE));
  __m512i q=_mm512_add_epi32(_mm512_shuffle_i32x4(ab,cd,0x88),_mm512_shuffle_i32x4(ab,cd,0xDD));
  // q: 128-bit block i = vector i's 4 partial sums (a,b,c,d)
  __m128i t0=_mm512_castsi512_si128(q),t1=_mm512_extracti32x4_epi32(q,1),t2=_mm512_extracti32x4_epi32(q,2),t3=_mm512_extracti32x4_epi32(q,3);
  __m128i u0=_mm_unpacklo_epi32(t0,t1),u1=_mm_unpackhi_epi32(t0,t1),u2=_mm_unpacklo_epi32(t2,t3),u3=_mm_unpackhi_epi32(t2,t3);
  __m128i r0=_mm_unpacklo_epi64(u0,u2),r1=_mm_unpackhi_epi64(u0,u2),r2=_mm_unpacklo_epi64(u1,u3),r3=_mm_unpackhi_epi64(u1,u3);
  return _mm_add_epi32(_mm_add_epi32(r0,r1),_mm_add_epi32(r2,r3));
}
__attribute__((target("avx512vnni,avx512dq,avx512vl")))
void vnni(const int8_t* W,const float* sc,int N,int K,const Planes& s,float* y){
  const __m512i flip=_mm512_set1_epi8((char)0x80);
  const uint8_t *p0=s.p.data(),*p1=p0+K,*p2=p1+K,*p3=p2+K;
  const __m256i corr=_mm256_set1_epi64x(-128*256*s.topsum);
  const __m256d unit=_mm256_set1_pd(ldexp(1.0,-s.E));
  for(int r=0;r<N;r+=4){
    __m512i a00=_mm512_setzero_si512(),a01=a00,a02=a00,a03=a00,a10=a00,a11=a00,a12=a00,a13=a00,a20=a00,a21=a00,a22=a00,a23=a00,a30=a00,a31=a00,a32=a00,a33=a00;
    const int8_t* w0=W+(int64_t)r*K; const int8_t *w1=w0+K,*w2=w1+K,*w3=w2+K;
    for(int k=0;k<K;k+=64){
      __m512i x0=_mm512_loadu_si512(p0+k),x1=_mm512_loadu_si512(p1+k),x2=_mm512_loadu_si512(p2+k),x3=_mm512_loadu_si512(p3+k);
      PIN(x0);PIN(x1);PIN(x2);PIN(x3);
#define ROW(i) { __m512i w=_mm512_loadu_si512(w##i+k); PIN(w); a##i##0=_mm512_dpbusd_epi32(a##i##0,x0,w); a##i##1=_mm512_dpbusd_epi32(a##i##1,x1,w); a##i##2=_mm512_dpbusd_epi32(a##i##2,x2,w); a##i##3=_mm512_dpbusd_epi32(a##i##3,_mm512_xor_si512(w,flip),x3); }
      ROW(0) ROW(1) ROW(2) ROW(3)
    }
    // planes 0+1 and 2+3 combined lane-wise in int32 (exact for K <= 4096), then reduced
    __m512i l0=_mm512_add_epi32(a00,_mm512_slli_epi32(a01,8)),h0=_mm512_add_epi32(a02,_mm512_slli_epi32(a03,8));
    __m512i l1=_mm512_add_epi32(a10,_mm512_slli_epi32(a11,8)),h1=_mm512_add_epi32(a12,_mm512_slli_epi32(a13,8));
    __m512i l2=_mm512_add_epi32(a20,_mm512_slli_epi32(a21,8)),h2=_mm512_add_epi32(a22,_mm512_slli_epi32(a23,8));
    __m512i l3=_mm512_add_epi32(a30,_mm512_slli_epi32(a31,8)),h3=_mm512_add_epi32(a32,_mm512_slli_epi32(a33,8));
    __m128i sl=hsum4i(l0,l1,l2,l3),sh=hsum4i(h0,h1,h2,h3);
    __m256i t=_mm256_add_epi64(_mm256_cvtepi32_epi64(sl),_mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(sh),corr),16));
    __m256d v=_mm256_mul_pd(_mm256_mul_pd(_mm256_cvtepi64_pd(t),unit),_mm256_cvtps_pd(_mm_loadu_ps(sc+r)));
    _mm_storeu_ps(y+r,_mm256_cvtpd_ps(v));
  }
}
int main(){
  int shapes[][2]={{32000,256},{1024,256},{256,512},{64,8192}};
  for(auto& sh:shapes){ int N=sh[0],K=sh[1];
    vector<int8_t> W((size_t)N*K); vector<float> sc(N),x(K),y0(N),y1(N);
    srand(1); for(auto& w:W) w=(rand()%255)-127; for(auto& v:sc) v=0.01f*(1+rand()%7); for(auto& v:x) v=(rand()/(float)RAND_MAX-0.5f)*((rand()%10)==0?10:1);
    Planes s; split(x.data(),K,s);
    int reps=max(1,200000000/(N*K)); double b0=1e9,b1=1e9,bs=1e9;
    for(int t=0;t<15;t++){
      double t0=now(); for(int i=0;i<reps;i++) widen(W.data(),sc.data(),N,K,x.data(),y0.data()); b0=min(b0,(now()-t0)/reps);
      t0=now(); for(int i=0;i<reps;i++) vnni(W.data(),sc.data(),N,K,s,y1.data()); b1=min(b1,(now()-t0)/reps);
      t0=now(); for(int i=0;i<reps;i++) split(x.data(),K,s); bs=min(bs,(now()-t0)/reps);
    }
    double e0=0,e1=0;
    for(int r=0;r<N;r++){ double t=0,a=0; for(int k=0;k<K;k++){t+=(double)W[(size_t)r*K+k]*x[k];a+=fabs((double)W[(size_t)r*K+k]*x[k]);} t*=sc[r];a*=sc[r];
      e0=max(e0,fabs(y0[r]-t)/a); e1=max(e1,fabs(y1[r]-t)/max(fabs(t),1e-30)); }
    printf("%5dx%4d widen %.1f Gw/s  vnni4 %.1f Gw/s (%.2fx)  split %.2f us   err widen/sum|wx| %.1e  vnni rel %.1e\n",N,K,N*K/b0/1e9,N*K/b1/1e9,b0/b1,bs*1e6,e0,e1);
  }
}
