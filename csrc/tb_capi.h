// The C ABI of torch_budget: every exported function, in one place, prefix tb_.
//
// Rules: nothing here throws or aborts. Functions return 0 (or a valid pointer, or a
// length) on success and a tb::ErrorCode (nullptr, or a negative code) on failure;
// tb_last_error() then gives the message for this thread. Python declares every
// signature once, in torch_budget/_native.py.
#pragma once

#include <stdint.h>
#include <sys/types.h>

#define TB_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

// --- errors
TB_API const char* tb_last_error(void);  // message of the last failure on this thread
TB_API int tb_last_error_code(void);

// --- setup
// Settings for every device; fails once allocations were served.
// budget_bytes < 0 and budget_fraction <= 0: no budget (the whole card).
// map_run_bytes: the longest VMM mapping an allocation makes (0: 16 MiB).
TB_API int tb_configure(int64_t budget_bytes, double budget_fraction, int default_route, int reuse_before_grow,
                        int64_t map_run_bytes);
TB_API int tb_device_count(void);
// Capabilities of a device: out[0] vmm, out[1] pools, out[2] granularity, out[3] total bytes.
TB_API int tb_capabilities(int device, int64_t out[4]);
// The route an allocation asking for `route` gets on `device` (the fallback rule); < 0 on error.
TB_API int tb_route_for(int device, int route);

// --- the allocation functions; signatures match CUDAPluggableAllocator's
// alloc_fn `void*(ssize_t size, int device, cudaStream_t stream)` and
// free_fn `void(void* ptr, ssize_t size, int device, cudaStream_t stream)`.
TB_API void* tb_malloc(ssize_t size, int device, void* stream);
TB_API void tb_free(void* ptr, ssize_t size, int device, void* stream);
// Checked variant of tb_free: non-zero for a pointer that is not ours or was freed.
TB_API int tb_free_checked(void* ptr);
// The block at `ptr` is also used on `stream` of device `stream_device`
// (torch's recordStream(DataPtr, CUDAStream)).
TB_API int tb_record_stream(void* ptr, void* stream, int stream_device);

// --- scopes and tags
TB_API int tb_push_scope(int route, int tag);  // route -1 / tag -1 keep the enclosing one
TB_API int tb_set_default_tag(int tag);        // the tag outside every scope, on every thread (0: none)
TB_API int tb_pop_scope(void);
TB_API int tb_tag_id(const char* name);        // registers on first use; < 0 on error

// --- budget, cache, peers
// bytes >= 0, or (bytes < 0) a fraction in (0, 1] of the card.
TB_API int tb_set_budget(int device, int64_t bytes, double fraction);
// Note [Tag budgets] (core/budget.h): the budget of `tag` on `device` (bytes >= 0, or a
// fraction in (0, 1] of the card; bytes < 0 and fraction <= 0 remove it), and the same
// for every device before the first allocation (after tb_configure, which clears them).
TB_API int tb_set_tag_budget(int device, int tag, int64_t bytes, double fraction);
TB_API int tb_configure_tag_budget(int tag, int64_t bytes, double fraction);
// The budget of devices created from now on (tag < 0), or of `tag` on them, at any time (bytes
// and fraction as above); `was_bytes` / `was_fraction` receive the setting replaced.
TB_API int tb_set_later_budget(int tag, int64_t bytes, double fraction, int64_t* was_bytes, double* was_fraction);
// Note [Packing time] (core/packing_time.h): the share of wall-clock time in [0, 1] the VMM
// route may spend moving memory to pack it (0: never before the budget refuses; 1: always),
// for every device, before the first allocation (after tb_configure, which resets it to 0.03).
TB_API int tb_configure_packing_time(double share);
// The time that has passed on `device` until now earns no packing credit (Note [Packing time]):
// for a process that was paused on purpose, such as a benchmark's process waiting for its turn.
TB_API int tb_packing_idle(int device);
// The packing credit of `device` is a full burst again, as at the process's start (Note [Packing
// time]): for a benchmark that replays one trace after another in one process, each as a process
// of its own would.
TB_API int tb_packing_refill(int device);
TB_API int tb_empty_cache(int device);
// torch's emptyCache(mempool_id): the cached memory of private pool (id0, id1) only.
TB_API int tb_empty_pool_cache(int device, uint64_t id0, uint64_t id1);
// torch's resetPeakStats: every peak of `device` starts again from its current value, the
// packing line's high-water mark included (Note [Packing: reclaim before growth]).
TB_API int tb_reset_peak_stats(int device);
// The IPC handle of the live block at `ptr` (torch's shareIpcHandle) into buf[0, cap):
// its length, or -1 with the error kept (cap too small included: then nothing is shared);
// *offset: ptr's offset in it.
TB_API int64_t tb_share(void* ptr, char* buf, int64_t cap, int64_t* offset);
// No other process maps the live block at `ptr` any more: its tag may be released again
// (Note [Sharing memory between processes]). 0, or an error code.
TB_API int tb_end_sharing(void* ptr);
// torch's cacheInfo(device, &largest): the longest free stretch usable without new memory.
TB_API int tb_cache_info(int device, int64_t* largest);
// torch's inactive_split and inactive_split_bytes (current), each as [all, small pool, large pool].
TB_API int tb_inactive_split(int device, int64_t* count, int64_t* bytes);
// Testing: the driver entry points that take memory fail at `rate` from now on (see
// Note [Injected driver failures]); returns the failures injected so far, -1 without a driver.
TB_API int64_t tb_inject_driver_faults(double rate, uint64_t seed);
// Memory of `device` becomes accessible from `peer` (torch's enablePeerAccess(peer, device)).
TB_API int tb_grant_peer(int device, int peer);

// --- sleep / wake (VMM memory under a tag; csrc/core/tag_sleep.h)
TB_API int tb_tag_find(const char* name);  // id of a known tag, -1 if none has that name
TB_API int tb_device_ready(int device);    // 1 once torch_budget serves allocations on `device`
// backup: 0 none, 1 memset, 2 cpu, 3 pinned, 4 disk (files in the directory
// tb_set_disk_backup_dir names, Note [Disk backups], core/disk_backup.h); | 0x100 retains a
// cpu / pinned backup past the restore (Note [Retained backups], core/tag_sleep.h).
TB_API int tb_release_tag(int device, int tag, int backup);
// As tb_release_tag; `ptrs` (n of them) are live allocations of the tag whose contents need not
// survive: mapped back by the restore, never copied (Note [Discardable blocks], core/tag_sleep.h).
TB_API int tb_release_tag_discarding(int device, int tag, int backup, const uint64_t* ptrs, int64_t n);
TB_API int tb_restore_tag(int device, int tag);
// The directory disk backups go to (it must exist and be writable; "" or NULL forgets it).
TB_API int tb_set_disk_backup_dir(const char* dir);
// Gives back the backup a live tag retained.
TB_API int tb_drop_tag_backup(int device, int tag);
// While the tag is released with a cpu / pinned backup: whether its restore keeps the backup.
TB_API int tb_retain_tag_backup(int device, int tag, int on);
// out: life (0 live, 1 released, 2 restoring), backup (-1 never released), resident bytes,
// released bytes, device bytes and backup bytes the last release / restore moved, host
// bytes of the backup held, 1 when a live tag retains its backup.
TB_API int tb_tag_info(int device, int tag, int64_t out[8]);
// Note [Reading backups] (core/tag_sleep.h): the backup of bytes [offset, offset + bytes) of the
// live block at `base`, while its tag is released or retains its backup. tb_backup_read copies
// it into dst; tb_backup_view gives its address in place (*host) and a handle (*view) that keeps
// that host memory alive until tb_backup_view_end(*view), a restore included. *found = 0 / both
// null, nothing copied, when the block's tag has no backup with contents now. A view needs the
// bytes in one piece of host memory (else kNotAvailable).
TB_API int tb_backup_read(void* base, int64_t offset, int64_t bytes, void* dst, int* found);
TB_API int tb_backup_view(void* base, int64_t offset, int64_t bytes, void** host, void** view);
TB_API void tb_backup_view_end(void* view);
// The tag of graph pool (id0, id1) / of the live block at `ptr`; -1 when there is none.
TB_API int tb_pool_tag(int device, uint64_t id0, uint64_t id1);
TB_API int tb_ptr_tag(void* ptr);
// The device of the live block at `ptr`; -1 when there is none.
TB_API int tb_ptr_device(void* ptr);
// Gives the tag's clean cached memory back to the driver; *returned: bytes.
TB_API int tb_trim_tag(int device, int tag, int64_t* returned);
// The pinned host pool that backups use (process-wide).
TB_API int tb_host_pool_reserve(int64_t bytes);
TB_API int tb_host_pool_free(void);
// keep 0: memory pinned at a release is unpinned when its last backup goes (Note [Keeping
// pinned memory]); 1: kept until tb_host_pool_free (the default). *was: the previous setting.
TB_API int tb_host_pool_set_keep(int keep, int* was);
// out: pinned bytes, bytes holding backups, chunks, bytes pinned at release, ns spent pinning,
// bytes pinned by registering memory the pool mapped (the fast way: Note [Pinning fast]), keep.
TB_API int tb_host_pool_stats(int64_t out[8]);

// --- graph pools (torch's begin/end allocate-to-pool and release-pool)
// Allocations on `stream` go to pool (id0, id1) until tb_end_pool.
TB_API int tb_begin_pool(int device, uint64_t id0, uint64_t id1, void* stream);
TB_API int tb_end_pool(int device, uint64_t id0, uint64_t id1);
TB_API int tb_release_pool(int device, uint64_t id0, uint64_t id1);
// torch's graph_capture_record_stream_reuse, for the whole process (Note [Reuse during
// capture], csrc/core/capture_graph.h); read at the next free during capture.
TB_API void tb_capture_reuse(int on);

// Pool checkpoints (csrc/core/pool_checkpoint.h): a checkpoint id >= 0, or -code.
TB_API int tb_pool_checkpoint(int device, uint64_t id0, uint64_t id1);
// Restores checkpoint `checkpoint` (which stays valid): *n_freed / *n_created addresses
// (at most `capacity` of each are written) of the blocks freed and re-created, also when
// it fails part-way (then nothing is re-created).
TB_API int tb_pool_restore(int device, int checkpoint, uint64_t* freed, int64_t* n_freed, uint64_t* created,
                           int64_t* n_created, int64_t capacity);
TB_API int tb_pool_checkpoint_drop(int checkpoint);
// 1 when the pool's allocated blocks are exactly ptrs[0..n), 0 when not, < 0 on error.
TB_API int tb_pool_live_matches(int device, uint64_t id0, uint64_t id1, const uint64_t* ptrs, int64_t n);
// torch's MemPool options: use_on_oom (-1 leaves it, 0 off, 1 on), no_split (1: never split).
TB_API int tb_pool_options(int device, uint64_t id0, uint64_t id1, int use_on_oom, int no_split);

// --- ledger, as JSON written into the caller's buffer: returns the full length
// (call again with a larger buffer when it exceeds `capacity`), or -code.
TB_API int64_t tb_stats_json(int device, char* buffer, int64_t capacity);
TB_API int64_t tb_segments_json(int device, char* buffer, int64_t capacity);

// --- torch (only in the library built with torch, torch_budget/_C)
// Installs the torch allocator; fails when torch's allocator is already initialised.
TB_API int tb_torch_install(void);
// Note [Installing without the driver]: as tb_torch_install, leaving the driver to the first allocation.
TB_API int tb_torch_install_deferred(void);
TB_API int tb_torch_installed(void);

// --- testing (only in the library built with the host stand-in, torch_budget/_host_core);
// see csrc/testing/host_driver.cpp.
TB_API int tb_host_use(int devices, int64_t capacity, int vmm, int pools, int64_t pool_chunk);
TB_API void tb_host_pool_chunk(int64_t pool_chunk);
TB_API void* tb_host_stream(int device);
TB_API void tb_host_submit(void* stream);
TB_API void tb_host_complete(void* stream);
TB_API int64_t tb_host_used(int device);
TB_API void tb_host_counters(int64_t out[8]);
TB_API void tb_host_event_calls(int64_t out[2]);
TB_API int64_t tb_host_captured_ordered_calls(void);
TB_API int tb_host_fail(const char* entry_point, int64_t nth, double rate, int result, uint64_t seed);
TB_API int tb_host_set_current(int device);
TB_API int tb_host_current(void);
TB_API int tb_host_can_access(int device, void* ptr);
TB_API int tb_host_hold_syncs(int hold, int wait_for);
// While syncs are held, the next n synchronisations go through anyway.
TB_API void tb_host_pass_syncs(int n);
TB_API int tb_host_remove_entry(const char* name);
TB_API void tb_host_free_at_exit(void* ptr);
TB_API int tb_host_poke(void* va, const void* src, int64_t bytes);
TB_API int tb_host_peek(void* va, void* dst, int64_t bytes);
TB_API int64_t tb_host_pinned(void);
// Counts the allocator's trace events by action (core/trace.h) from now on; counts[9].
TB_API void tb_host_trace(int on, int64_t counts[9]);
// Capture, as the stand-in's streams report it: `stream` captures sequence `capture`
// (0: not capturing; one sequence, one graph) and now ends in tails[0..n). Graph nodes
// are numbers; tb_host_node gives node `node` the dependencies parents[0..n).
TB_API void tb_host_capture(void* stream, uint64_t capture, const uint64_t* tails, int n);
TB_API void tb_host_node(uint64_t node, const uint64_t* parents, int n);
// A private pool whose own allocator (a MemPool's) frees only after checking that another thread
// can allocate meanwhile (route_user.h); out: its allocations, frees, frees under the lock, ends
// of the allocator, ends under the lock.
TB_API int tb_host_user_pool(int device, uint64_t id0, uint64_t id1);
TB_API void tb_host_user_counts(int64_t out[5]);
// tb_malloc under a quiet first attempt (Note [A quiet first attempt], core/device_allocator.h).
TB_API void* tb_host_malloc_quiet(int64_t size, int device, void* stream);
// Note [The parked block] (device_allocator.h) on or off for every device.
TB_API void tb_host_parking(int on);
// The stream clock's mark interval (stream_order.h) for every device, in microseconds; 0 makes a
// program's marks depend on its frees alone, not on how fast it runs.
TB_API void tb_host_mark_interval(int64_t microseconds);
// Opens n bytes of a share handle on `device` and closes it again: 0 or the error code.
TB_API int tb_host_open_share(int device, const char* bytes, int64_t n);
// Opens a share and keeps it open as a consumer would: an id (> 0) for tb_host_close_opened, or
// minus the error code; *ptr and *size: the mapping.
TB_API int64_t tb_host_open_kept(int device, const char* bytes, int64_t n, uint64_t* ptr, uint64_t* size);
TB_API void tb_host_close_opened(int device, int64_t id);
// [imports made, cuIpcOpenMemHandle mappings open, physical handles, address reservations].
TB_API void tb_host_import_counts(int64_t out[4]);
// Replays a trace over the core in C (the core's own time per operation; tools/sim_alloc.py).
TB_API int64_t tb_host_replay(const int64_t* ids, const int64_t* sizes, const int8_t* stream_of, int64_t n,
                              void* const* streams, int num_streams, void** slots, int64_t num_slots);

#ifdef __cplusplus
}
#endif
