#include "trace.h"

namespace tb {

namespace detail {
std::atomic<TraceSink> trace_sink{nullptr};
}

void set_trace_sink(TraceSink sink) { detail::trace_sink.store(sink, std::memory_order_release); }

}  // namespace tb
