#include "digest.h"

#include "digest_ptx.h"
#include "error.h"

namespace tb {
namespace {

constexpr unsigned kThreads = 256;

uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

}  // namespace

Digest digest_host(const uint64_t* words, size_t n) {
  Digest d{0, 0};
  for (uint64_t i = 0; i < n; ++i) {
    d[0] += fmix64(words[i] ^ (i * 0x9e3779b97f4a7c15ull));
    d[1] += fmix64((words[i] + 0x632be59bd9b4e019ull) * (2 * i + 1));
  }
  return d;
}

bool Digester::available(std::string* why) {
  if (state_ == 0) {
    const DriverApi* d = driver();
    if (d->moduleLoadData == nullptr || d->moduleGetFunction == nullptr || d->launchKernel == nullptr) {
      why_ = "the driver has no cuModuleLoadData / cuLaunchKernel";
      state_ = -1;
    } else {
      ContextGuard guard(ctx_.ctx);
      CUresult r = guard.ok() ? d->moduleLoadData(&module_, kDigestPtx) : CUDA_ERROR_INVALID_CONTEXT;
      if (r == CUDA_SUCCESS) r = d->moduleGetFunction(&kernel_, module_, "tb_digest");
      if (r == CUDA_SUCCESS) {
        state_ = 1;
      } else {
        const char* name = nullptr;
        d->getErrorName(r, &name);
        why_ = std::string("the driver could not load the digest kernel (") + (name ? name : "?") + ")";
        state_ = -1;
      }
    }
  }
  if (why != nullptr) *why = why_;
  return state_ == 1;
}

bool Digester::digest(CUstream stream, uintptr_t va, size_t chunks, size_t chunk_bytes, std::vector<Digest>* out) {
  std::string why;
  TB_REQUIRE(available(&why), kNotAvailable, why, false);
  TB_REQUIRE(chunk_bytes % 8 == 0, kInvalidArgument, "internal: digest chunks of " + std::to_string(chunk_bytes) +
             " bytes", false);
  if (chunks == 0) return true;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const DriverApi* d = driver();
  if (chunks > scratch_chunks_) {
    if (scratch_ != 0) d->memFree(scratch_);
    scratch_ = 0;
    scratch_chunks_ = 0;
    TB_DRIVER_CHECK(d->memAlloc(&scratch_, chunks * sizeof(Digest)), false);
    scratch_chunks_ = chunks;
  }
  TB_DRIVER_CHECK(d->memsetD8Async(scratch_, 0, chunks * sizeof(Digest), stream), false);
  CUdeviceptr base = va;
  unsigned long long words = chunk_bytes / 8;
  CUdeviceptr dst = scratch_;
  void* params[] = {&base, &words, &dst};
  TB_DRIVER_CHECK(d->launchKernel(kernel_, static_cast<unsigned>(chunks), 1, 1, kThreads, 1, 1, 0, stream, params,
                                  nullptr),
                  false);
  host_.resize(chunks * 2);
  TB_DRIVER_CHECK(d->memcpyDtoHAsync(host_.data(), scratch_, chunks * sizeof(Digest), stream), false);
  TB_DRIVER_CHECK(d->streamSynchronize(stream), false);
  for (size_t i = 0; i < chunks; ++i) out->push_back(Digest{host_[2 * i], host_[2 * i + 1]});
  return true;
}

}  // namespace tb
