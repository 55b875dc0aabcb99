// clover-calibration-cache.h - block size auto's cost curve kept on disk between processes
// (not installed; the curve itself is clover-planner.h).
#pragma once

#include "clover.h"
#include "ggml-backend.h"

#include <string>
#include <vector>

struct clover_context;

namespace clover_impl {

// The context's cost curve from the disk cache, else measured (calibrate) and stored; sets
// planner.last_calibration (1 measured, 2 read). Without a cache (calib_cache = 0, no cache
// folder, a model without a file) it measures.
int calibrate_cached(clover_context * c, std::string & msg);
// coreset auto's C into c->coreset (spec/decoding.md, "The block expert coreset"): decided once per context,
// from the disk cache, else measured and stored
int resolve_coreset_auto(clover_context * c, std::string & msg);

// the backend set of a load (RPC servers and their devices, offloaded layers, split, overrides),
// so that a cost curve measured on one placement is never reused for another: part of the key
std::string placement_key(const clover_model_params & mp, const std::vector<ggml_backend_dev_t> & devices);

} // namespace clover_impl
