#include "digest.h"

#include "digest_ptx.h"
#include "error.h"

namespace tb {
namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kParts = 8;  // blocks per chunk: a 2 MiB granule is 8 blocks of 256 KiB

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

bool Digester::begin(size_t chunks) {
  std::string why;
  TB_REQUIRE(available(&why), kNotAvailable, why, false);
  batches_.clear();
  used_ = 0;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const DriverApi* d = driver();
  if (chunks > host_capacity_) {  // pinned results: kept for the next release
    if (results_ != nullptr) d->memFreeHost(results_);
    results_ = nullptr;
    host_capacity_ = 0;
    void* host = nullptr;
    TB_DRIVER_CHECK(d->memHostAlloc(&host, chunks * sizeof(Digest), 0), false);
    results_ = static_cast<uint64_t*>(host);
    host_capacity_ = chunks;
  }
  if (chunks <= capacity_) return true;
  if (!free_buffers()) return false;
  TB_DRIVER_CHECK(d->memAlloc(&addresses_, chunks * sizeof(uint64_t)), false);
  TB_DRIVER_CHECK(d->memAlloc(&digests_, chunks * sizeof(Digest)), false);
  capacity_ = chunks;
  return true;
}

void Digester::end(CUstream stream) {
  // addresses_ alone is held too when begin() could not have digests_.
  if (addresses_ == 0 && digests_ == 0) return;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return;
  const DriverApi* d = driver();
  d->streamSynchronize(stream);  // nothing queued may still use the buffers
  // One the driver keeps is freed by the next begin() or end(); the caller's error stays its own.
  const KeepError kept;
  free_buffers();
  batches_.clear();
  used_ = 0;
}

bool Digester::free_buffers() {
  // A buffer is forgotten only once the driver took it back: between releases the driver must
  // hold nothing the ledger does not (see the top of digest.h).
  for (CUdeviceptr* buf : {&addresses_, &digests_}) {
    if (*buf == 0) continue;
    const CUdeviceptr ptr = *buf;
    const CUresult r = retry_driver([&] { return driver()->memFree(ptr); });
    if (r != CUDA_SUCCESS) return fail_driver(r, "cuMemFree", __FILE__, __LINE__);
    *buf = 0;
  }
  capacity_ = 0;
  return true;
}

bool Digester::start(CUstream stream, const std::vector<uintptr_t>& addresses, size_t chunk_bytes, size_t* batch) {
  const size_t n = addresses.size();
  TB_REQUIRE(chunk_bytes % 8 == 0 && used_ + n <= capacity_ && used_ + n <= host_capacity_, kInvalidArgument,
             "internal: a digest batch past begin()'s room, or chunks of " + std::to_string(chunk_bytes) + " bytes",
             false);
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const DriverApi* d = driver();
  if (batches_.size() == events_.size()) {
    CUevent e = nullptr;
    TB_DRIVER_CHECK(d->eventCreate(&e, CU_EVENT_DISABLE_TIMING), false);
    events_.push_back(e);
  }
  const CUevent done = events_[batches_.size()];
  if (n > 0) {
    const CUdeviceptr at_addresses = addresses_ + used_ * sizeof(uint64_t);
    CUdeviceptr at_digests = digests_ + used_ * sizeof(Digest);
    TB_DRIVER_CHECK(d->memcpyHtoDAsync(at_addresses, addresses.data(), n * sizeof(uint64_t), stream), false);
    TB_DRIVER_CHECK(d->memsetD8Async(at_digests, 0, n * sizeof(Digest), stream), false);
    unsigned long long words = chunk_bytes / 8;
    unsigned int parts = words % kParts == 0 ? kParts : 1;
    CUdeviceptr chunks = at_addresses;
    void* params[] = {&chunks, &words, &parts, &at_digests};
    TB_DRIVER_CHECK(d->launchKernel(kernel_, static_cast<unsigned>(n * parts), 1, 1, kThreads, 1, 1, 0, stream,
                                    params, nullptr),
                    false);
    TB_DRIVER_CHECK(d->memcpyDtoHAsync(results_ + 2 * used_, at_digests, n * sizeof(Digest), stream), false);
  }
  TB_DRIVER_CHECK(d->eventRecord(done, stream), false);
  batches_.push_back(Batch{used_, n, done});
  used_ += n;
  *batch = batches_.size() - 1;
  return true;
}

bool Digester::finish(size_t batch, std::vector<Digest>* out) {
  TB_REQUIRE(batch < batches_.size(), kInvalidArgument, "internal: no digest batch " + std::to_string(batch), false);
  const Batch& b = batches_[batch];
  TB_DRIVER_CHECK(driver()->eventSynchronize(b.done), false);
  for (size_t i = b.first; i < b.first + b.count; ++i) out->push_back(Digest{results_[2 * i], results_[2 * i + 1]});
  return true;
}

}  // namespace tb
