// The digest kernel of retained backups (Note [Retained backups], core/tag_sleep.h). Its PTX
// is generated into core/digest_ptx.h by tools/gen_digest_ptx.sh (nvcc is needed only then:
// the driver compiles the PTX when it is first used), and core/digest.cpp computes the same
// digest on the host.
//
// Each chunk (a granule) is `words` 8-byte words at chunks[c]; `parts` blocks share a chunk, block
// b taking part b % parts of chunk b / parts. Every word is mixed with its index in the chunk into
// two independent 64-bit values, which are summed (mod 2^64): a 128-bit digest that does not depend
// on the order of the sums, so threads and blocks add theirs with atomics.

__device__ __forceinline__ unsigned long long fmix64(unsigned long long k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

extern "C" __global__ void tb_digest(const unsigned long long* const* __restrict__ chunks, unsigned long long words,
                                     unsigned int parts, unsigned long long* __restrict__ out) {
  const unsigned int c = blockIdx.x / parts, part = blockIdx.x % parts;
  const unsigned long long per = words / parts, first = part * per;
  const unsigned long long* p = chunks[c];
  unsigned long long a = 0, b = 0;
  for (unsigned long long i = first + threadIdx.x; i < first + per; i += blockDim.x) {
    const unsigned long long w = p[i];
    a += fmix64(w ^ (i * 0x9e3779b97f4a7c15ull));
    b += fmix64((w + 0x632be59bd9b4e019ull) * (2 * i + 1));
  }
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, o);
    b += __shfl_down_sync(0xffffffffu, b, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(out + 2 * c, a);
    atomicAdd(out + 2 * c + 1, b);
  }
}
