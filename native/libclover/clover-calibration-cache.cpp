// clover-calibration-cache.cpp - block size auto's cost curve kept on disk: one small text file
// per (model file, placement, backend, build, threads) under $CLOVER_CACHE_DIR, else
// $XDG_CACHE_HOME/clover-cpp, else ~/.cache/clover-cpp. The first lines repeat the key; an entry
// that does not match it or does not parse is measured again and replaced (written to a
// temporary file, then renamed).

#include "clover-calibration-cache.h"
#include "clover-impl.h"

namespace clover_impl {

static std::string calib_cache_dir() {
    if (const char * d = getenv("CLOVER_CACHE_DIR"); d && *d) {
        return d;
    }
    if (const char * x = getenv("XDG_CACHE_HOME"); x && *x) {
        return std::string(x) + "/clover-cpp";
    }
    if (const char * h = getenv("HOME"); h && *h) {
        return std::string(h) + "/.cache/clover-cpp";
    }
    return "";
}

static std::string calib_key(const clover_context * c) {
    struct stat st {};
    if (c->model->path.empty() || stat(c->model->path.c_str(), &st) != 0) {
        return "";
    }
    std::ostringstream k;
    k << "clover-calibration 2\n"
      << "model " << c->model->path << "\n"
      << "file " << (long long) st.st_size << " " << (long long) st.st_mtim.tv_sec << "." << st.st_mtim.tv_nsec
      << " " << (long long) st.st_ino << "\n"
      << "build " << __DATE__ << " " << __TIME__ << " " << CLOVER_API_VERSION << "\n"
      << "backend";
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        k << " " << ggml_backend_dev_name(ggml_backend_dev_get(i));
    }
    k << "\nplacement " << c->model->placement;
    k << "\nsystem " << llama_print_system_info() << "\n"
      << "threads " << c->n_threads << " flash_attn " << c->flash_attn << " kv_f32 " << c->kv_f32
      << " n_ctx " << c->n_ctx << "\n";
    return k.str();
}

std::string placement_key(const clover_model_params & mp, const std::vector<ggml_backend_dev_t> & devices) {
    std::ostringstream k;
    k << "n_gpu_layers " << mp.n_gpu_layers << " rpc [" << (mp.rpc_servers ? mp.rpc_servers : "") << "] devices";
    for (ggml_backend_dev_t dev : devices) {
        if (dev) { // the endpoint (RPC) or the device's own description, and its type
            k << " " << ggml_backend_dev_description(dev) << "/" << (int) ggml_backend_dev_type(dev);
        }
    }
    k << " split";
    for (int32_t i = 0; i < mp.n_tensor_split && mp.tensor_split; ++i) {
        k << " " << mp.tensor_split[i];
    }
    k << " ot [" << (mp.tensor_overrides ? mp.tensor_overrides : "") << "]";
    std::string s = k.str();
    std::replace(s.begin(), s.end(), '\n', ' '); // the key is line-oriented
    return s;
}

static std::string calib_path(const std::string & dir, const std::string & key) {
    uint64_t h = 1469598103934665603ull; // FNV-1a
    for (unsigned char ch : key) {
        h = (h ^ ch) * 1099511628211ull;
    }
    char name[64];
    snprintf(name, sizeof(name), "/calibration-%016llx.txt", (unsigned long long) h);
    return dir + name;
}

// true = the cost curve was read from the entry; false = absent, stale or corrupt (*bad = the
// entry exists but cannot be trusted)
static bool calib_load(clover_context * c, const std::string & path, const std::string & key, bool * bad) {
    *bad = false;
    std::error_code ec;
    const auto      st = std::filesystem::status(path, ec);
    if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st)) {
        *bad = true; // a FIFO would block the open forever, a device never ends: measure again
        return false; // (and the store renames a regular file into its place)
    }
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    *bad = true;
    if (text.compare(0, key.size(), key) != 0) {
        return false;
    }
    std::istringstream in(text.substr(key.size()));
    const std::vector<int32_t> sizes = auto_candidates(c);
    std::vector<double> ms(sizes.size()), msf(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
        std::string tag;
        long long   B = 0;
        if (!(in >> tag >> B >> ms[i] >> msf[i]) || tag != "cost" || B != sizes[i] || !plausible_step_ms(ms[i]) ||
            !plausible_step_ms(msf[i])) {
            return false;
        }
    }
    std::string end;
    if (!(in >> end) || end != "end") {
        return false;
    }
    *bad = false;
    c->planner.set_curve(sizes, ms, msf, false);
    return true;
}

static void calib_store(const clover_planner & pl, const std::string & dir, const std::string & path,
                        const std::string & key) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string tmp = path + ".tmp" + std::to_string((long long) getpid());
    {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        if (!f) {
            return; // a cache we cannot write is no error
        }
        f << key;
        char line[96];
        for (size_t i = 0; i < pl.sizes.size(); ++i) {
            snprintf(line, sizeof(line), "cost %d %.6f %.6f\n", pl.sizes[i], pl.pass_ms[i], pl.fused_ms[i]);
            f << line;
        }
        f << "end\n";
        if (!f.flush()) {
            f.close();
            std::filesystem::remove(tmp, ec);
            return;
        }
    }
    if (rename(tmp.c_str(), path.c_str()) != 0) {
        std::filesystem::remove(tmp, ec);
    }
}

// The measurement can take many seconds on a large model, before the first token:
// one line says so, once per process, where a front end asked for its notices (clover_set_notices:
// the command lines) or at verbosity 1 and up; a quiet library prints nothing.
static std::atomic<bool> g_notices{false};
static std::once_flag    g_measuring_said;

static void say_measuring(const std::string & dir) {
    if (!g_notices.load() && g_verbosity.load() < 1) {
        return;
    }
    std::call_once(g_measuring_said, [&] {
        fprintf(stderr, "clover: measuring the cost curve of block size auto (once per model file and machine%s)\n",
                dir.empty() ? "" : ("; kept in " + dir).c_str());
        fflush(stderr);
    });
}

// The cost curve from the disk cache, else measured (and stored).
int calibrate_cached(clover_context * c, std::string & msg) {
    const std::string dir = c->planner.use_cache ? calib_cache_dir() : "";
    const std::string key = dir.empty() ? "" : calib_key(c);
    const std::string path = key.empty() ? "" : calib_path(dir, key);
    if (!path.empty()) {
        bool bad = false;
        if (calib_load(c, path, key, &bad)) {
            c->planner.last_calibration = 2;
            return CLOVER_OK;
        }
        if (bad) {
            fprintf(stderr, "clover: warning: the calibration cache entry %s is stale, corrupt or holds impossible costs; measuring again\n",
                    path.c_str());
        }
    }
    say_measuring(dir);
    const int rc = calibrate(c, msg);
    if (rc != CLOVER_OK) {
        return rc;
    }
    c->planner.last_calibration = 1;
    if (!path.empty()) {
        calib_store(c->planner, dir, path, key);
    }
    return CLOVER_OK;
}

// Coreset auto's decision on disk: an entry of its own, keyed by the cost curve's key and the
// block size it was measured at, holding "coreset C" then "end". An entry without a decision that
// parses (one written before, or corrupt) is measured again and replaced.
static bool coreset_load(const clover_context * c, const std::string & path, const std::string & key, int32_t & C) {
    std::error_code ec;
    const auto      st = std::filesystem::status(path, ec);
    if (ec || !std::filesystem::is_regular_file(st)) {
        return false; // (absent, or a FIFO that would block the open)
    }
    std::ifstream f(path, std::ios::binary);
    std::string   text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (text.compare(0, key.size(), key) != 0) {
        return false;
    }
    std::istringstream         in(text.substr(key.size()));
    std::string                tag, end;
    long long                  v  = -1;
    const std::vector<int32_t> Cs = coreset_auto_candidates(c);
    if (!(in >> tag >> v >> end) || tag != "coreset" || end != "end" ||
        (v != 0 && std::find(Cs.begin(), Cs.end(), v) == Cs.end())) {
        return false;
    }
    C = (int32_t) v;
    return true;
}

static void coreset_store(const std::string & dir, const std::string & path, const std::string & key, int32_t C) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string tmp = path + ".tmp" + std::to_string((long long) getpid());
    {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        if (!f || !(f << key << "coreset " << C << "\nend\n") || !f.flush()) {
            f.close();
            std::filesystem::remove(tmp, ec);
            return; // a cache we cannot write is no error
        }
    }
    if (rename(tmp.c_str(), path.c_str()) != 0) {
        std::filesystem::remove(tmp, ec);
    }
}

// Coreset auto's C in this context: decided once (kept in the planner), from the disk cache, else
// measured (or the injected probe) and stored. Leaves the context empty when it measures.
int resolve_coreset_auto(clover_context * c, std::string & msg) {
    clover_planner & pl = c->planner;
    if (pl.coreset_auto_C < 0) {
        const std::string dir  = pl.use_cache ? calib_cache_dir() : "";
        const std::string base = dir.empty() ? "" : calib_key(c);
        const std::string key  = base.empty() ? "" : base + "coreset auto B " + std::to_string(coreset_auto_B(c)) + "\n";
        const std::string path = key.empty() ? "" : calib_path(dir, key);
        int32_t           C    = 0;
        if (path.empty() || !coreset_load(c, path, key, C)) {
            clover_planner::coreset_probe p = pl.probe;
            if (!pl.probe_set) {
                const int rc = measure_coreset_auto(c, p, msg);
                if (rc != CLOVER_OK) {
                    return rc;
                }
            }
            C = pick_coreset_auto(p);
            if (!path.empty()) {
                coreset_store(dir, path, key, C);
            }
        }
        pl.coreset_auto_C = C;
    }
    c->coreset      = pl.coreset_auto_C;
    c->coreset_auto = false;
    return CLOVER_OK;
}

} // namespace clover_impl

extern "C" {

// The command lines' switch for the measuring notice (say_measuring)
CLOVER_API void clover_set_notices(int on) {
    clover_impl::g_notices.store(on != 0);
}

} // extern "C"
