// clover-log.cpp - llama.cpp/ggml log capture, error strings and status names.

#include "clover-impl.h"

namespace clover_impl {

std::atomic<int> g_verbosity{0};
thread_local std::string g_last_log_error; // last llama.cpp/ggml error line(s) on this thread
thread_local int g_last_level = GGML_LOG_LEVEL_NONE;
std::mutex       g_rpc_error_mutex;
std::string      g_rpc_error; // the RPC backend logs a lost server from its own thread

std::string rpc_error() {
    std::lock_guard<std::mutex> lock(g_rpc_error_mutex);
    return g_rpc_error;
}

// llama.cpp warnings that libclover's own decoding causes on purpose, once per block: a block
// pass decodes the block's positions again over the recurrent state that precedes them, which
// llama.cpp's recurrent memory (find_slot) reports as a skipped position. Debug lines for us.
static bool expected_warning(const char * text) {
    static const char * const expected[] = {"find_slot: non-consecutive token position"};
    for (const char * prefix : expected) {
        if (text && strncmp(text, prefix, strlen(prefix)) == 0) {
            return true;
        }
    }
    return false;
}

void log_callback(ggml_log_level level, const char * text, void * /*user*/) {
    if (level == GGML_LOG_LEVEL_WARN && expected_warning(text)) {
        level = GGML_LOG_LEVEL_DEBUG;
    }
    int eff = level == GGML_LOG_LEVEL_CONT ? g_last_level : (int) level;
    if (level != GGML_LOG_LEVEL_CONT) {
        g_last_level = level;
    }
    if (eff == GGML_LOG_LEVEL_ERROR && text && strncmp(text, "RPC server ", 11) == 0) {
        std::lock_guard<std::mutex> lock(g_rpc_error_mutex);
        g_rpc_error = text;
        while (!g_rpc_error.empty() && isspace((unsigned char) g_rpc_error.back())) {
            g_rpc_error.pop_back();
        }
    }
    if (eff == GGML_LOG_LEVEL_ERROR && text) {
        // keep every error line since the last clear: the first one usually names the cause
        if (level != GGML_LOG_LEVEL_CONT && !g_last_log_error.empty()) {
            g_last_log_error += "; ";
        }
        g_last_log_error += text;
        if (g_last_log_error.size() > 2000) {
            g_last_log_error.erase(0, g_last_log_error.size() - 2000);
        }
    }
    const int v = g_verbosity.load();
    if (text && (v >= 2 || (v >= 1 && eff >= GGML_LOG_LEVEL_WARN))) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

std::once_flag g_init_once;

void ensure_init() {
    std::call_once(g_init_once, [] {
        llama_log_set(log_callback, nullptr);
        llama_backend_init();
    });
}

std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) {
        s.pop_back();
    }
    std::replace(s.begin(), s.end(), '\n', ' ');
    for (size_t at; (at = s.find(" ; ")) != std::string::npos;) {
        s.erase(at, 1);
    }
    return s;
}


std::string last_log_error() {
    return trim(g_last_log_error);
}

int set_err(char * err, size_t err_len, int code, const std::string & msg) {
    if (err && err_len > 0) {
        snprintf(err, err_len, "%s", msg.c_str());
    }
    return code;
}

int clear_err(char * err, size_t err_len) {
    if (err && err_len > 0) {
        err[0] = '\0';
    }
    return CLOVER_OK;
}

// Runs f() and turns C++ exceptions into status codes (never lets them cross the C ABI).

// llama.cpp's RPC backend, when built in (GGML_RPC). The patched backend (patch 0006) counts lost
// connections instead of aborting the process; a model on RPC devices checks the count.
ggml_backend_reg_t rpc_backend() {
    return ggml_backend_reg_by_name("RPC");
}

uint64_t rpc_failures() {
    static uint64_t (*n_failures)(void) = nullptr;
    static std::once_flag once;
    std::call_once(once, [] {
        if (ggml_backend_reg_t reg = rpc_backend()) {
            n_failures = (uint64_t (*)(void)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_n_failures");
        }
    });
    return n_failures ? n_failures() : 0;
}


} // namespace clover_impl

using namespace clover_impl;

extern "C" {

const char * clover_status_str(int status) {
    switch (status) {
        case CLOVER_OK:                   return "ok";
        case CLOVER_ERR_INVALID_ARG:      return "invalid argument";
        case CLOVER_ERR_LOAD:             return "load error";
        case CLOVER_ERR_DECODE:           return "decode error";
        case CLOVER_ERR_CANCELLED:        return "cancelled";
        case CLOVER_ERR_CONTEXT_FULL:     return "context full";
        case CLOVER_ERR_BUFFER_TOO_SMALL: return "buffer too small";
        case CLOVER_ERR_INTERNAL:         return "internal error";
        default:                          return "unknown status";
    }
}

void clover_set_verbosity(int level) {
    ensure_init();
    g_verbosity.store(level);
}

} // extern "C"
