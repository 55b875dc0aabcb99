// clover-time.h - milliseconds on the steady clock, for the planner's measurements and a call's
// stats (not installed).
#pragma once

#include <chrono>

namespace clover_impl {

inline double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

} // namespace clover_impl
