#include "capture_graph.h"

#include "driver.h"

namespace tb {
namespace {

struct CaptureInfo {
  cuuint64_t id = 0;
  CUgraph graph = nullptr;
  const CUgraphNode* tails = nullptr;
  size_t count = 0;
};

// `stream`'s capture status and what it captures; false when the driver cannot say.
bool query(CUstream stream, CUstreamCaptureStatus* status, CaptureInfo* out) {
  const DriverApi* d = driver();
  if (d == nullptr || d->streamGetCaptureInfo == nullptr) return false;
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUgraphEdgeData* edges = nullptr;  // asked for: without it, edges with data fail the query
  return d->streamGetCaptureInfo(stream, status, &out->id, &out->graph, &out->tails, &edges, &out->count) ==
         CUDA_SUCCESS;
}

bool capture_info(CUstream stream, CaptureInfo* out) {
  CUstreamCaptureStatus status;
  return driver() != nullptr && driver()->has_capture_graph() && query(stream, &status, out) &&
         status == CU_STREAM_CAPTURE_STATUS_ACTIVE;
}

// The nodes `node` depends on; false when the driver cannot say.
bool dependencies(CUgraphNode node, std::vector<CUgraphNode>* deps, std::vector<CUgraphEdgeData>* edges) {
  const DriverApi* d = driver();
  size_t count = 0;
  if (d->graphNodeGetDependencies(node, nullptr, nullptr, &count) != CUDA_SUCCESS) return false;
  deps->resize(count);
  edges->resize(count);
  if (count == 0) return true;
  if (d->graphNodeGetDependencies(node, deps->data(), edges->data(), &count) != CUDA_SUCCESS) return false;
  deps->resize(count);
  return true;
}

}  // namespace

bool may_be_capturing(CUstream stream) {
  CaptureInfo info;
  CUstreamCaptureStatus status;
  return !query(stream, &status, &info) || status != CU_STREAM_CAPTURE_STATUS_NONE;
}

uint64_t capture_id(CUstream stream) {
  CaptureInfo info;
  return capture_info(stream, &info) ? info.id : 0;
}

bool capture_tails(const std::vector<CUstream>& streams, std::vector<CUgraphNode>* out, uint64_t* id) {
  out->clear();
  CUgraph graph = nullptr;
  for (CUstream s : streams) {
    CaptureInfo info;
    if (!capture_info(s, &info)) return false;
    if (graph != nullptr && info.graph != graph) return false;
    graph = info.graph;
    *id = info.id;
    out->insert(out->end(), info.tails, info.tails + info.count);
  }
  return true;
}

const std::unordered_set<CUgraphNode>* CaptureWalks::reached(CUstream stream) {
  CaptureInfo info;
  if (!capture_info(stream, &info) || info.count == 0) return nullptr;
  Walk* walk = nullptr;
  for (Walk& w : walks_)
    if (w.capture == info.id && w.stream == stream) walk = &w;
  if (walk == nullptr) walk = &walks_.emplace_back(Walk{info.id, stream, {}, {}});
  std::vector<CUgraphNode> deps;
  std::vector<CUgraphEdgeData> edges;
  // From the current tails, stopping at nodes reached before; `met` the ones stopped at.
  auto extend = [&](std::unordered_set<CUgraphNode>* met) {
    std::unordered_set<CUgraphNode> fresh;
    std::vector<CUgraphNode> todo(info.tails, info.tails + info.count);
    while (!todo.empty()) {
      CUgraphNode n = todo.back();
      todo.pop_back();
      if (walk->seen.count(n)) {
        if (met != nullptr) met->insert(n);
        continue;
      }
      // A node whose dependencies cannot be read is not counted as reached: the blocks
      // it would free wait for the end of capture.
      if (fresh.count(n) || !dependencies(n, &deps, &edges)) continue;
      fresh.insert(n);
      todo.insert(todo.end(), deps.begin(), deps.end());
    }
    return fresh;
  };
  std::unordered_set<CUgraphNode> met;
  std::unordered_set<CUgraphNode> fresh = extend(&met);
  bool grew = true;  // the last tails are reached again: what was reached before still is
  for (CUgraphNode t : walk->tails) grew = grew && (met.count(t) > 0 || fresh.count(t) > 0);
  if (!grew) {  // its dependencies were set anew: Note [Reuse during capture]
    walk->seen.clear();
    fresh = extend(nullptr);
  }
  walk->seen.insert(fresh.begin(), fresh.end());
  walk->tails.assign(info.tails, info.tails + info.count);
  return &walk->seen;
}

}  // namespace tb
