// clover-model.cpp - loading a clover GGUF: pre-checks, RPC devices, the llama.cpp model,
// metadata and the tokenizer calls.

#include "clover-impl.h"
#include "clover-calibration-cache.h"

#include <map>
#include <regex>
#include <string_view>
#include <unordered_map>

namespace clover_impl {

static std::string check_vocab(const gguf_context * g);

// The generic llama.cpp loader GGML_ASSERTs (aborts) on some counts; check them first.
std::string check_hparams(const gguf_context * g) {
    auto get_u32 = [&](const char * key, int64_t & out) {
        const int64_t id = gguf_find_key(g, key);
        if (id < 0) {
            return false;
        }
        switch (gguf_get_kv_type(g, id)) {
            case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, id); return true;
            case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, id); return true;
            default:               return false;
        }
    };
    int64_t n_layer = 0, n_expert = 0, n_used = 0;
    if (!get_u32("clover.block_count", n_layer) || n_layer < 1 || n_layer > 512) {
        return "clover.block_count must be a u32 in [1, 512]";
    }
    if (!get_u32("clover.expert_count", n_expert) || n_expert < 1 || n_expert > 1024) {
        return "clover.expert_count must be a u32 in [1, 1024]";
    }
    if (!get_u32("clover.expert_used_count", n_used) || n_used < 1 || n_used > n_expert) {
        return "clover.expert_used_count must be a u32 in [1, clover.expert_count]";
    }
    // values llama.cpp asserts on (or loops forever on) must be refused here, with a message
    const struct { const char * key; int64_t lo, hi; } sizes[] = {
        {"clover.embedding_length", 1, 1 << 20},        {"clover.attention.head_count", 1, 4096},
        {"clover.attention.head_count_kv", 1, 4096},     {"clover.attention.key_length", 1, 65536},
        {"clover.attention.value_length", 1, 65536},     {"clover.ssm.conv_kernel", 1, 64},
        {"clover.ssm.state_size", 1, 65536},            {"clover.ssm.group_count", 1, 65536},
        {"clover.ssm.time_step_rank", 1, 65536},        {"clover.ssm.inner_size", 1, 1 << 24},
        {"clover.context_length", 1, 1 << 24},
        {"clover.diffusion.block_size", 1, 1 << 20}, // (2**31 + 5 was read as -2147483643)
    };
    for (const auto & sz : sizes) {
        int64_t v = 0;
        if (gguf_find_key(g, sz.key) >= 0 && (!get_u32(sz.key, v) || v < sz.lo || v > sz.hi)) {
            return std::string(sz.key) + " must be a u32 in [" + std::to_string(sz.lo) + ", " + std::to_string(sz.hi) + "]";
        }
    }
    int64_t n_head = 0, n_head_kv = 0, n_rot = 0, head_k = 0;
    if (get_u32("clover.attention.head_count", n_head) && get_u32("clover.attention.head_count_kv", n_head_kv) &&
        n_head % n_head_kv != 0) {
        return "clover.attention.head_count must be a multiple of clover.attention.head_count_kv";
    }
    if (gguf_find_key(g, "clover.rope.dimension_count") >= 0) {
        get_u32("clover.attention.key_length", head_k);
        if (!get_u32("clover.rope.dimension_count", n_rot) || n_rot < 2 || n_rot % 2 != 0 ||
            (head_k > 0 && n_rot > head_k)) {
            return "clover.rope.dimension_count must be an even u32 in [2, clover.attention.key_length]";
        }
    }
    for (const char * key : {"clover.attention.layer_norm_rms_epsilon", "clover.rope.freq_base"}) {
        const int64_t id = gguf_find_key(g, key);
        if (id < 0) {
            continue;
        }
        const bool  f32 = gguf_get_kv_type(g, id) == GGUF_TYPE_FLOAT32;
        const float v   = f32 ? gguf_get_val_f32(g, id) : 0.0f;
        const bool  eps = strstr(key, "epsilon") != nullptr;
        if (!f32 || !std::isfinite(v) || v <= 0.0f || (eps && v >= 1.0f)) {
            return std::string(key) + (eps ? " must be an f32 in (0, 1)" : " must be a finite f32 > 0");
        }
    }
    // the graph reads these as F32 (ggml's norm, ssm_conv and elementwise ops assert on others)
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        const std::string name = gguf_get_tensor_name(g, i);
        auto ends = [&](const char * suffix) {
            const size_t n = strlen(suffix);
            return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
        };
        const bool must_f32 = ends("norm.weight") || ends("ssm_conv1d.weight") || ends("ssm_conv1d_look.weight") ||
                              ends("ssm_dt.bias") || ends("ssm_a") || ends("ssm_block_calib") ||
                              name.find(".ssm_bd_") != std::string::npos;
        if (must_f32 && gguf_get_tensor_type(g, i) != GGML_TYPE_F32) {
            return "tensor '" + name + "' must be F32, not " + ggml_type_name(gguf_get_tensor_type(g, i));
        }
    }
    return check_vocab(g);
}

// llama-vocab.cpp GGML_ASSERTs (aborts the process) when one token string is on two ids
// (id_to_token.size() == token_to_id.size()): refuse it here, naming the string and both ids
static std::string check_vocab(const gguf_context * g) {
    const int64_t id = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (id < 0) {
        return "";  // the loader's own message
    }
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != GGUF_TYPE_STRING) {
        return "tokenizer.ggml.tokens must be an array of strings";
    }
    const size_t n = gguf_get_arr_n(g, id);
    std::unordered_map<std::string_view, size_t> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        const char * s = gguf_get_arr_str(g, id, i);
        const auto [it, fresh] = seen.emplace(std::string_view(s), i);
        if (!fresh) {
            std::string shown;
            for (const char c : std::string_view(s).substr(0, 48)) {  // printable, one line
                char buf[8];
                if ((unsigned char) c < 0x20 || c == 0x7f || c == '\\') {
                    snprintf(buf, sizeof(buf), "\\x%02x", (unsigned char) c);
                    shown += buf;
                } else {
                    shown += c;
                }
            }
            return "tokenizer.ggml.tokens: the token '" + shown + (strlen(s) > 48 ? "...'" : "'") + " is at ids " +
                   std::to_string(it->second) + " and " + std::to_string(i) +
                   " (a vocabulary holds each string once; the file is damaged)";
        }
    }
    return "";
}

int check_block_diffusion(const clover_model * m, int32_t B, std::string & msg) {
    if (B <= 1 || !m || m->has_block_operator) {
        return CLOVER_OK;
    }
    msg = "block diffusion (block size " + std::to_string(B) + " without draft-self) needs a block operator this model "
          "lacks: its GGUF has the release's block softmax (bd_softmax_*, clover.block_operator = release-bd-softmax), "
          "whose math is not public, and not Clover's (ssm_mix, ssm_block_calib); use block size 1 or draft-self";
    return CLOVER_ERR_INVALID_ARG;
}

int check_mask_token(const clover_model * m, const std::string & what, std::string & msg) {
    if (!m || m->mask >= 0) {
        return CLOVER_OK;
    }
    if (!m->causal_arch.empty()) {
        msg = what + " needs a 'clover' model: this is a '" + m->causal_arch + "' GGUF, which llama.cpp decodes "
              "causally (its graph has no canvas), so it runs at block size 1; for block diffusion and draft-self "
              "convert the checkpoint with clover convert";
        return CLOVER_ERR_INVALID_ARG;
    }
    msg = what + " needs a mask token and this model has none (its GGUF has no tokenizer.ggml.mask_token_id: the "
                 "release publishes none), so it runs causally only (block size 1); to enable it, add \"mask_token_id\" "
                 "to the checkpoint's config.json and convert again";
    return CLOVER_ERR_INVALID_ARG;
}

} // namespace clover_impl

using namespace clover_impl;

extern "C" {

clover_model_params clover_model_default_params(void) {
    clover_model_params p;
    p.n_gpu_layers   = 0;
    p.use_mmap       = -1;
    p.use_mlock      = 0;
    p.rpc_servers    = nullptr;
    p.tensor_split   = nullptr;
    p.n_tensor_split = 0;
    p.tensor_overrides = nullptr;
    return p;
}

// The devices of the comma-separated RPC endpoints, then the local GPUs (llama.cpp's own order:
// RPC servers first), NULL-terminated for llama_model_params.devices.
static int rpc_devices(const char * servers, std::vector<ggml_backend_dev_t> & devices, std::string & msg) {
    ggml_backend_reg_t reg = rpc_backend();
    auto add_server = reg ? (ggml_backend_reg_t (*)(const char *)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_add_server")
                          : nullptr;
    if (!add_server) {
        msg = "this libclover was built without llama.cpp's RPC backend (GGML_RPC=OFF)";
        return CLOVER_ERR_INVALID_ARG;
    }
    std::stringstream ss(servers);
    std::string       ep;
    while (std::getline(ss, ep, ',')) {
        ep = trim(ep);
        const size_t colon = ep.rfind(':');
        char *       end   = nullptr;
        const long   port  = colon == std::string::npos ? 0 : strtol(ep.c_str() + colon + 1, &end, 10);
        if (colon == 0 || colon == std::string::npos || !end || *end || port < 1 || port > 65535) {
            msg = "RPC server '" + ep + "' is not HOST:PORT";
            return CLOVER_ERR_INVALID_ARG;
        }
        const uint64_t     before = rpc_failures();
        ggml_backend_reg_t server = add_server(ep.c_str());
        const bool         lost   = rpc_failures() != before; // then the backend said why, e.g.
        if (!server || lost) {                                 // "RPC server HOST:PORT: cannot connect"
            msg = lost && !rpc_error().empty() ? rpc_error() : "RPC server " + ep + " offers no device";
            return CLOVER_ERR_LOAD;
        }
        for (size_t i = 0; i < ggml_backend_reg_dev_count(server); ++i) {
            devices.push_back(ggml_backend_reg_dev_get(server, i));
        }
    }
    if (devices.empty()) {
        msg = "no RPC server given";
        return CLOVER_ERR_INVALID_ARG;
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const auto         t   = ggml_backend_dev_type(dev);
        if ((t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU) &&
            ggml_backend_dev_backend_reg(dev) != reg) {
            devices.push_back(dev);
        }
    }
    devices.push_back(nullptr);
    return CLOVER_OK;
}

// "PATTERN=BUFFER[,PATTERN=BUFFER...]" as llama.cpp's -ot: tensors whose name matches PATTERN
// (a regex) go to that buffer type: CPU, a local device's, or an RPC server's ("RPC0[host:port]").
// Terminated by an empty override; the patterns live in `patterns` (reserved: no reallocation).
static int tensor_overrides(const char * spec, const std::vector<ggml_backend_dev_t> & rpc,
                            std::vector<std::string> & patterns, std::vector<llama_model_tensor_buft_override> & out,
                            std::string & msg) {
    std::map<std::string, ggml_backend_buffer_type_t> bufts;
    auto add = [&](ggml_backend_dev_t dev) {
        if (ggml_backend_buffer_type_t b = dev ? ggml_backend_dev_buffer_type(dev) : nullptr) {
            bufts[ggml_backend_buft_name(b)] = b;
        }
    };
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        add(ggml_backend_dev_get(i));
    }
    for (ggml_backend_dev_t dev : rpc) {
        add(dev);
    }
    const std::string all = spec;
    patterns.reserve(std::count(all.begin(), all.end(), ',') + 1);
    std::stringstream ss(all);
    for (std::string item; std::getline(ss, item, ',');) {
        const size_t eq = item.rfind('=');
        const std::string buf = eq == std::string::npos ? "" : trim(item.substr(eq + 1));
        if (eq == std::string::npos || eq == 0 || !bufts.count(buf)) {
            msg = "tensor override '" + item + "': expected PATTERN=BUFFER with BUFFER one of:";
            for (const auto & [name, b] : bufts) {
                msg += " " + name;
            }
            return CLOVER_ERR_INVALID_ARG;
        }
        try {
            std::regex re(item.substr(0, eq)); // as llama.cpp will use it: a bad one fails here, not there
        } catch (const std::regex_error &) {
            msg = "tensor override '" + item + "': not a valid regular expression";
            return CLOVER_ERR_INVALID_ARG;
        }
        patterns.push_back(item.substr(0, eq));
        out.push_back({patterns.back().c_str(), bufts[buf]});
    }
    out.push_back({nullptr, nullptr});
    return CLOVER_OK;
}

clover_model * clover_model_load(const char * path, const clover_model_params * params, char * err, size_t err_len) {
    clover_model * result = nullptr;
    guarded(err, err_len, [&]() -> int {
        ensure_init();
        clear_err(err, err_len);
        if (!path) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "model path is NULL");
        }
        const clover_model_params mp = params ? *params : clover_model_default_params();
        {
            // a FIFO or a device would block or stream forever: only regular files are models
            struct stat st;
            if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("'") + path + "' is not a regular file");
            }
        }
        {
            FILE * f = fopen(path, "rb");
            if (!f) {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("cannot open model file '") + path + "': " + strerror(errno));
            }
            char magic[4] = {0, 0, 0, 0};
            const size_t got = fread(magic, 1, 4, f);
            fclose(f);
            if (got != 4 || memcmp(magic, "GGUF", 4) != 0) {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("'") + path + "' is not a GGUF file (bad magic)");
            }
        }
        std::string causal_arch; // (a 'qwen35moe' GGUF: see below)
        {
            gguf_init_params gp;
            gp.no_alloc = true;
            gp.ctx      = nullptr;
            g_last_log_error.clear();
            gguf_context * g = gguf_init_from_file(path, gp);
            if (!g) {
                std::string m = std::string("'") + path + "' is not a valid GGUF file";
                const std::string le = last_log_error();
                if (!le.empty()) {
                    m += ": " + le;
                }
                return set_err(err, err_len, CLOVER_ERR_LOAD, m);
            }
            const int64_t k = gguf_find_key(g, "general.architecture");
            std::string   arch;
            if (k >= 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_STRING) {
                arch = gguf_get_val_str(g, k);
            }
            const std::string bad = arch == "clover" ? check_hparams(g) : "";
            gguf_free(g);
            if (k < 0) {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("'") + path + "' has no general.architecture key");
            }
            if (arch != "clover" && arch != "qwen35moe") {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("'") + path + "' is a '" + arch +
                                   "' model, not a 'clover' model (general.architecture; a 'qwen35moe' one runs "
                                   "causally)");
            }
            causal_arch = arch == "clover" ? "" : arch;
            if (!bad.empty()) {
                return set_err(err, err_len, CLOVER_ERR_LOAD, std::string("'") + path + "': " + bad);
            }
        }
        llama_model_params lp = llama_model_default_params();
        lp.n_gpu_layers       = mp.n_gpu_layers;
        std::vector<ggml_backend_dev_t> devices;
        std::vector<float>              split;
        if (mp.rpc_servers && *mp.rpc_servers) {
            std::string bad;
            const int rc = rpc_devices(mp.rpc_servers, devices, bad);
            if (rc != CLOVER_OK) {
                return set_err(err, err_len, rc, bad);
            }
            lp.devices = devices.data();
        }
        if (mp.n_tensor_split < 0 || mp.n_tensor_split > (int32_t) llama_max_devices() ||
            (mp.n_tensor_split > 0 && !mp.tensor_split)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                           "tensor_split: 0.." + std::to_string(llama_max_devices()) + " values expected");
        }
        if (mp.n_tensor_split > 0) {
            split.assign(llama_max_devices(), 0.0f);
            for (int32_t i = 0; i < mp.n_tensor_split; ++i) {
                if (!std::isfinite(mp.tensor_split[i]) || mp.tensor_split[i] < 0) {
                    return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "tensor_split values must be finite and >= 0");
                }
                split[i] = mp.tensor_split[i];
            }
            lp.tensor_split = split.data();
        }
        std::vector<std::string>                      ot_patterns;
        std::vector<llama_model_tensor_buft_override> ot;
        if (mp.tensor_overrides && *mp.tensor_overrides) {
            std::string bad;
            if (tensor_overrides(mp.tensor_overrides, devices, ot_patterns, ot, bad) != CLOVER_OK) {
                return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, bad);
            }
            lp.tensor_buft_overrides = ot.data();
        }
        const uint64_t rpc_failures_before = rpc_failures();
        if (mp.use_mmap < 0 && !mp.use_mlock) {
            lp.load_mode = LLAMA_LOAD_MODE_AUTO;
        } else if (mp.use_mmap != 0) {
            lp.load_mode = mp.use_mlock ? LLAMA_LOAD_MODE_MMAP_MLOCK : LLAMA_LOAD_MODE_MMAP;
        } else {
            lp.load_mode = mp.use_mlock ? LLAMA_LOAD_MODE_MLOCK : LLAMA_LOAD_MODE_NONE;
        }
        g_last_log_error.clear();
        llama_model * lm = llama_model_load_from_file(path, lp);
        if (!lm) {
            std::string m = std::string("llama.cpp failed to load '") + path + "'";
            const std::string le = last_log_error();
            if (!le.empty()) {
                m += ": " + le;
            }
            return set_err(err, err_len, CLOVER_ERR_LOAD, m);
        }
        auto * cm        = new clover_model();
        cm->lm           = lm;
        cm->on_rpc           = !devices.empty();
        cm->rpc_failures_now = rpc_failures();
        cm->placement        = placement_key(mp, devices);
        if (cm->on_rpc && cm->rpc_failures_now != rpc_failures_before) {
            clover_model_free(cm);
            return set_err(err, err_len, CLOVER_ERR_LOAD, "while loading: " + rpc_error());
        }
        {
            std::error_code ec;
            const auto abs = std::filesystem::canonical(path, ec);
            cm->path       = ec ? std::string(path) : abs.string();
        }
        cm->vocab        = llama_model_get_vocab(lm);
        cm->n_vocab      = llama_vocab_n_tokens(cm->vocab);
        char buf[64];
        if (llama_model_meta_val_str(lm, "tokenizer.ggml.mask_token_id", buf, sizeof(buf)) > 0) {
            cm->mask = (int32_t) strtol(buf, nullptr, 10);
        } else {
            cm->mask = llama_vocab_mask(cm->vocab);
        }
        if (cm->mask >= cm->n_vocab) {
            cm->mask = -1;
        }
        cm->eos = llama_vocab_eos(cm->vocab);
        if (llama_model_meta_val_str(lm, "clover.diffusion.block_size", buf, sizeof(buf)) > 0) {
            cm->train_block = (int32_t) strtol(buf, nullptr, 10);
        }
        // (the loader refused any other value; no key: a file of ours)
        cm->has_block_operator = !(llama_model_meta_val_str(lm, "clover.block_operator", buf, sizeof(buf)) > 0 &&
                                   std::string(buf) == "release-bd-softmax");
        // the GGUFs users already have of Qwen3.5-MoE (the release's converter writes that architecture):
        // llama.cpp's own graph, causal only (it has no canvas), so no mask token is used
        cm->causal_arch = causal_arch;
        if (!causal_arch.empty()) {
            cm->mask               = -1;
            cm->has_block_operator = false;
        }
        result = cm;
        return CLOVER_OK;
    });
    return result;
}

void clover_model_free(clover_model * model) {
    if (!model) {
        return;
    }
    if (model->lm) {
        llama_model_free(model->lm);
    }
    delete model;
}

int32_t clover_n_vocab(const clover_model * m) { return m ? m->n_vocab : 0; }
int32_t clover_mask_token(const clover_model * m) { return m ? m->mask : -1; }
int32_t clover_eos_token(const clover_model * m) { return m ? m->eos : -1; }
int32_t clover_bos_token(const clover_model * m) {
    return m && llama_vocab_get_add_bos(m->vocab) ? llama_vocab_bos(m->vocab) : -1;
}
int32_t clover_train_block_size(const clover_model * m) { return m ? m->train_block : 0; }
int32_t clover_n_ctx_train(const clover_model * m) { return m ? llama_model_n_ctx_train(m->lm) : 0; }

int32_t clover_model_meta(const clover_model * m, const char * key, char * buf, size_t buf_size) {
    if (!m || !key) {
        return -1;
    }
    return llama_model_meta_val_str(m->lm, key, buf, buf_size);
}

int clover_tokenize(const clover_model * m, const char * text, int32_t text_len, int32_t * tokens, int32_t n_max,
                    int add_special, int parse_special, int32_t * n_out) {
    return guarded(nullptr, 0, [&]() -> int {
        if (!m || !text || n_max < 0 || (n_max > 0 && !tokens)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        const int32_t len = text_len < 0 ? (int32_t) strlen(text) : text_len;
        const int32_t r   = llama_tokenize(m->vocab, text, len, tokens, n_max, add_special != 0, parse_special != 0);
        if (r == std::numeric_limits<int32_t>::min()) {
            return CLOVER_ERR_INVALID_ARG;
        }
        if (r < 0) {
            if (n_out) {
                *n_out = -r;
            }
            return CLOVER_ERR_BUFFER_TOO_SMALL;
        }
        if (n_out) {
            *n_out = r;
        }
        return CLOVER_OK;
    });
}

int clover_token_to_piece(const clover_model * m, int32_t token, char * buf, int32_t buf_size, int special,
                          int32_t * n_out) {
    return guarded(nullptr, 0, [&]() -> int {
        if (!m || token < 0 || token >= m->n_vocab || buf_size < 0 || (buf_size > 0 && !buf)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        const int32_t r = llama_token_to_piece(m->vocab, token, buf, buf_size, 0, special != 0);
        if (r < 0) {
            if (n_out) {
                *n_out = -r;
            }
            return CLOVER_ERR_BUFFER_TOO_SMALL;
        }
        if (n_out) {
            *n_out = r;
        }
        return CLOVER_OK;
    });
}

int clover_detokenize(const clover_model * m, const int32_t * tokens, int32_t n_tokens, char * buf, int32_t buf_size,
                      int remove_special, int unparse_special, int32_t * n_out) {
    return guarded(nullptr, 0, [&]() -> int {
        if (!m || n_tokens < 0 || (n_tokens > 0 && !tokens) || buf_size < 0 || (buf_size > 0 && !buf)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        for (int32_t i = 0; i < n_tokens; ++i) {
            if (tokens[i] < 0 || tokens[i] >= m->n_vocab) {
                return CLOVER_ERR_INVALID_ARG;
            }
        }
        const int32_t r =
            llama_detokenize(m->vocab, tokens, n_tokens, buf, buf_size, remove_special != 0, unparse_special != 0);
        if (r < 0 || r >= buf_size) { // no room for the terminator either
            if (n_out) {
                *n_out = r < 0 ? -r : r;
            }
            return CLOVER_ERR_BUFFER_TOO_SMALL;
        }
        buf[r] = '\0';
        if (n_out) {
            *n_out = r;
        }
        return CLOVER_OK;
    });
}

} // extern "C"
