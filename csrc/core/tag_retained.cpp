// Retained backups (Note [Retained backups], tag_sleep.h): the digests a restore keeps and the
// next release compares, and the pieces they belong to. The copy machinery is tag_sleep.cpp.
#include "tag_sleep.h"

#include <algorithm>

#include "error.h"
#include "route_vmm.h"

namespace tb {

bool TagMover::start_digests(const std::vector<Piece>& pieces, std::vector<size_t>* batch_of) {
  const size_t g = vmm_.granule();
  size_t granules = 0;
  for (const Piece& p : pieces) granules += p.count;
  if (!digester_.begin(granules)) return false;
  std::vector<uintptr_t> addresses;
  size_t started = 0;  // batches queued so far: the next one is number `started`
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    for (size_t j = 0; j < p.count; ++j) addresses.push_back(p.seg->base + (p.first + j) * g);
    batch_of->push_back(started);
    if (addresses.size() * g >= kDigestBatchBytes || i + 1 == pieces.size()) {
      size_t batch = 0;
      if (!digester_.start(stream_, addresses, g, &batch)) return false;
      addresses.clear();
      ++started;
    }
  }
  return true;
}

bool TagMover::reusable(const std::vector<Piece>& pieces, Backup mode, const TagState& state) const {
  if (state.kept.empty() || !state.space || mode != state.backup || pieces.size() != state.kept.size())
    return false;
  size_t granules = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& a = pieces[i];
    const Piece& b = state.kept[i];
    if (a.seg != b.seg || a.first != b.first || a.count != b.count || a.offset != b.offset) return false;
    granules += a.count;
  }
  return granules == state.digests.size();
}

void TagMover::keep_digests(TagState* state) {
  // Only a restore that mapped every granule back leaves a backup the next release can take,
  // and only a whole one (Note [Stale backups]).
  if (state->space->has_holes()) return;
  for (const Piece& p : state->pieces)
    if (p.discard) return;  // Note [Discardable blocks]: never copied, so never kept
  for (const Piece& p : state->pieces)
    for (size_t i = p.first; i < p.first + p.count; ++i)
      if (p.seg->granules[i] == 0) return;
  // The pieces the next release cuts from these granules: the restore's runs may join pieces
  // that continue each other in the segment and in the backup. (After a release that stayed
  // half done, the pieces are only some of the backup's, in no order: their offsets are kept.)
  const size_t g = vmm_.granule(), per_piece = std::max<size_t>(1, kPieceBytes / g);
  std::vector<Piece> recut;
  for (size_t i = 0; i < state->pieces.size();) {
    const Piece& p = state->pieces[i];
    size_t end = p.first + p.count, j = i + 1;
    for (; j < state->pieces.size(); ++j) {
      const Piece& q = state->pieces[j];
      if (q.seg != p.seg || q.first != end || q.offset != p.offset + (end - p.first) * g) break;
      end += q.count;
    }
    const size_t from = recut.size();
    cut_pieces(p.seg, p.first, end, per_piece, &recut);
    for (size_t k = from; k < recut.size(); ++k) recut[k].offset = p.offset + (recut[k].first - p.first) * g;
    i = j;
  }
  state->pieces = std::move(recut);
  std::vector<size_t> batch_of;
  std::vector<Digest> digests;
  bool ok = start_digests(state->pieces, &batch_of);
  const size_t batches = batch_of.empty() ? 0 : batch_of.back() + 1;
  for (size_t b = 0; b < batches && ok; ++b) ok = digester_.finish(b, &digests);
  digester_.end(stream_);
  if (!ok) {
    clear_error();  // the restore itself succeeded; the next release copies everything
    return;
  }
  state->kept = state->pieces;
  state->digests = std::move(digests);
  if (!state->pieces.empty()) state->kept_at = state->pieces.front().seg->pool->births();
}

}  // namespace tb
