// clover-cli: block-diffusion generation with a Clover GGUF, on the clover C API.
//
//   clover-cli -m model.gguf -p "prompt" [-n 128] [--block-size 32] [--threshold X] [--visual]
//
// Generated text goes to stdout, streamed block by block; the statistics line goes to stderr.

#include "clover.h"

#include <cerrno>
#include <csignal>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#if defined(_WIN32)
#include <io.h>
#define isatty _isatty
#define fileno _fileno
#else
#include <unistd.h>
#endif

namespace {

// -n's default, `clover run`'s too (clover_cpp/cli/options.py; a test keeps them equal); not the
// library's CLOVER_DEFAULT_MAX_TOKENS
constexpr int32_t DEFAULT_N_PREDICT = 128;

// clover_stats.mode as the stats line names it (the names of GenerationStats.mode in Python)
const char * mode_name(int32_t mode) {
    switch (mode) {
        case CLOVER_MODE_AUTOREGRESSIVE: return "autoregressive";
        case CLOVER_MODE_DIFFUSION:      return "diffusion";
        case CLOVER_MODE_DRAFT_SELF:     return "draft-self";
        default:                         return "none";
    }
}

void usage(const char * argv0) {
    fprintf(stdout,
            "usage: %s -m MODEL.gguf (-p PROMPT | -f FILE) [options]\n"
            "\n"
            "  -m, --model FILE       clover GGUF model\n"
            "  -p, --prompt TEXT      prompt\n"
            "  -f, --file FILE        read the prompt from a file\n"
            "  -n, --n-predict N      max tokens to generate (default %d; -1 = until EOS or the context's end)\n"
            "  -t, --threads N        CPU threads (default: from the hardware, as clover)\n"
            "  -c, --ctx-size N       context size in tokens (default 4096)\n"
            "  -ngl, --n-gpu-layers N layers to offload to the GPU or RPC servers (default 0)\n"
            "  --rpc HOST:PORT,...    llama.cpp RPC servers (ggml-rpc-server) for the offloaded layers\n"
            "  -ts, --tensor-split A,B,...  share of the offloaded layers per device (RPC first)\n"
            "  -ot, --override-tensor PATTERN=BUFFER,...  tensors matching PATTERN in BUFFER (as llama.cpp)\n"
            "  --block-size N|auto    block size B (default auto: B per block from the pass cost,\n"
            "                         measured once per model and machine and cached, and tokens/pass)\n"
            "  --threshold X          confidence threshold (default %g, the library's)\n"
            "  --step-cap N           denoising steps cap per block (default 0 = none; alias --max-steps)\n"
            "  --draft-self [on|off|auto]  lossless self-speculative decoding (alone = on): blocks drafted\n"
            "                         by block passes, verified by their causal commit (the output of\n"
            "                         --block-size 1); auto (also --draft-self=auto) with --block-size auto:\n"
            "                         the mode too is chosen per block (B = 1, block diffusion or\n"
            "                         draft-self); the stats line names the mode chosen\n"
            "  --coreset N|off|auto|model\n"
            "                         block expert coreset: each MoE layer of a block pass routes among the\n"
            "                         N experts the block weighs most (auto: 3 x the experts per token when\n"
            "                         below the expert count; default model: the GGUF's\n"
            "                         clover.expert_coreset, off when absent; draft-self's output is unchanged)\n"
            "  --expert-stats         count the distinct routed experts of each block pass (the stats line;\n"
            "                         a synchronisation per MoE layer of a pass: leave it off when timing)\n"
            "  --grammar GBNF         constrain the output to a GBNF grammar (llama.cpp's format); decoded\n"
            "                         at block size 1, or verified by --draft-self (spec/decoding.md)\n"
            "  --grammar-file FILE    the grammar from a file\n"
            "  -j, --json-schema JSON constrain the output to a JSON schema, as llama.cpp's converter writes\n"
            "                         it (a keyword it cannot enforce is refused; docs/server.md)\n"
            "  -jf, --json-schema-file FILE  the JSON schema from a file\n"
            "  --temp X               temperature (default 0 = greedy, as clover run; llama-cli: 0.8)\n"
            "  --top-k N              top-k (default 0 = off; llama-cli: 40)\n"
            "  --top-p X              top-p (default 1 = off; 0 = the most probable token; llama-cli: 0.95)\n"
            "  -s, --seed N           sampling seed (default 0; -1 = random, llama-cli's default)\n"
            "  llama.cpp's samplers (llama-cli's flags; every one off by default; spec/decoding.md):\n"
            "  --min-p X  --typical X  --top-nsigma X  --xtc-probability X  --xtc-threshold X\n"
            "  --repeat-penalty X  --repeat-last-n N  --presence-penalty X  --frequency-penalty X\n"
            "  --dry-multiplier X  --dry-base X  --dry-allowed-length N  --dry-penalty-last-n N\n"
            "  --dry-sequence-breaker S (repeatable)  --mirostat N  --mirostat-lr X  --mirostat-ent X\n"
            "  -l, --logit-bias TOKEN(+|-)BIAS (repeatable)  --samplers NAMES (';'-separated)\n"
            "  --sampling-seq LETTERS (e d s k y p m x t)  --dynatemp-range X  --dynatemp-exp X  --min-keep N\n"
            "  --ignore-eos           keep generating after EOS (alias --no-stop-at-eos)\n"
            "  -r, --reverse-prompt T stop before the text T (repeatable; matched across blocks)\n"
            "  -fa, --flash-attn X    flash attention: on, off or auto (default auto)\n"
            "  --no-echo              do not print the prompt first (alias --no-display-prompt)\n"
            "  --visual               show every denoising step of the current block (on a terminal;\n"
            "                         into a pipe stdout stays plain text, the steps go to stderr)\n"
            "  --no-special           do not parse special tokens in the prompt\n"
            "  -v, --verbose          llama.cpp log output to stderr (-v -v: everything)\n"
            "  -h, --help             this help\n",
            argv0, DEFAULT_N_PREDICT, clover_generate_default_params().threshold);
}

[[noreturn]] void die(const std::string & msg) {
    fprintf(stderr, "error: %s\n", msg.c_str());
    exit(1);
}

// the text of a --grammar-file / --json-schema-file (not empty)
std::string read_option_file(const std::string & what, const std::string & path) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {  // (a FIFO would block the read)
        die(what + " file '" + path + "' is not a readable file");
    }
    std::ifstream     f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    if (!f) {
        die("cannot read " + what + " file '" + path + "'");
    }
    if (ss.str().find_first_not_of(" \t\r\n") == std::string::npos) {
        die(what + " file '" + path + "' is empty");
    }
    return ss.str();
}

// the GBNF of a JSON schema (libclover: llama.cpp's converter); a schema it refuses ends the run
std::string schema_grammar(const std::string & schema) {
    char    err[1024];
    int32_t n  = 0;
    int     rc = clover_json_schema_to_grammar(schema.c_str(), nullptr, 0, &n, err, sizeof(err));
    if (rc == CLOVER_ERR_BUFFER_TOO_SMALL) {
        std::string out((size_t) n + 1, '\0');
        rc = clover_json_schema_to_grammar(schema.c_str(), out.data(), n + 1, &n, err, sizeof(err));
        if (rc == CLOVER_OK) {
            out.resize((size_t) n);
            return out;
        }
    }
    die(std::string("--json-schema: ") + err);
}

long parse_int(const std::string & opt, const char * v, long lo, long hi) {
    char * end = nullptr;
    errno      = 0;
    const long x = strtol(v, &end, 10);
    if (errno || !end || *end || end == v) {
        die("option " + opt + " expects an integer, got '" + v + "'");
    }
    if (x < lo || x > hi) {
        die("option " + opt + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v);
    }
    return x;
}

double parse_double(const std::string & opt, const char * v) {
    char * end = nullptr;
    errno      = 0;
    const double x = strtod(v, &end);
    if (errno || !end || *end || end == v || !std::isfinite(x)) {
        die("option " + opt + " expects a number, got '" + v + "'");
    }
    return x;
}

struct cli_state {
    clover_model * model      = nullptr;
    bool           visual     = false;
    bool           tty        = false;
    bool           block_open = false; // a live block view is on screen (tty)
    int32_t        mask       = -1;
    int32_t        n_prompt   = 0;
    std::string    piece_buf;
    std::string    echo;            // the prompt, printed when the generation starts (not before a refusal)
    bool           started = false; // a callback ran: the generation was not refused
    // -r/--reverse-prompt: the output stops before the first of these strings, which may span
    // blocks (libclover's clover_stop_matcher holds back what could still begin one)
    std::vector<std::string> stops;
    clover_stop_matcher *    matcher = nullptr;
    bool                     stopped = false;
};

// Print what is certainly before any stop string; true once a stop string was found.
bool emit(cli_state & st, const std::string & text) {
    int32_t      n   = 0;
    const char * out = clover_stop_matcher_feed(st.matcher, text.data(), (int32_t) text.size(), &n);
    if (out) {
        fwrite(out, 1, (size_t) n, stdout);
    }
    fflush(stdout);
    st.stopped = clover_stop_matcher_hit(st.matcher) != 0;
    return st.stopped;
}

std::string piece(clover_model * m, int32_t tok) {
    std::string s(64, '\0');
    int32_t     n  = 0;
    int         rc = clover_token_to_piece(m, tok, &s[0], (int32_t) s.size(), 0, &n);
    if (rc == CLOVER_ERR_BUFFER_TOO_SMALL) {
        s.assign((size_t) n, '\0');
        rc = clover_token_to_piece(m, tok, &s[0], (int32_t) s.size(), 0, &n);
    }
    if (rc != CLOVER_OK) {
        return "";
    }
    s.resize((size_t) n);
    return s;
}

// printable one-line rendering of a block for the live view
std::string render_block(cli_state & st, const int32_t * canvas, int32_t n, int32_t first) {
    std::string r;
    for (int32_t i = first; i < n; ++i) {
        if (canvas[i] == st.mask) {
            r += st.tty ? "\033[2m\xE2\x96\x91\033[0m" : "[MASK]"; // dim '░'
            continue;
        }
        for (char ch : piece(st.model, canvas[i])) {
            if (ch == '\n') {
                r += st.tty ? "\xE2\x86\xB5" : "\\n"; // '↵'
            } else if (ch == '\r' || ch == '\t') {
                r += ' ';
            } else {
                r += ch;
            }
        }
    }
    return r;
}

// Ctrl-C: the generation stops at the next denoising step (the callbacks return "cancel") and
// the tool exits 130 with one line, as `clover` does; a second Ctrl-C exits at once.
volatile sig_atomic_t g_interrupted = 0;
volatile sig_atomic_t g_loading     = 0; // in clover_model_load, which has no cancel hook (an RPC connect)

void on_sigint(int) {
    if (g_interrupted || g_loading) {
        if (g_loading) {
            const char msg[] = "error: interrupted\n";
            (void) !write(2, msg, sizeof(msg) - 1);
        }
        _exit(130);
    }
    g_interrupted = 1;
}

void flush_echo(cli_state & st) {
    st.started = true;
    if (!st.echo.empty()) {
        fwrite(st.echo.data(), 1, st.echo.size(), stdout);
        fflush(stdout);
        st.echo.clear();
    }
}

int on_step(int32_t block_start, const int32_t * canvas, int32_t block_size, int32_t n_masked, void * ud) {
    auto & st = *static_cast<cli_state *>(ud);
    flush_echo(st);
    if (g_interrupted) {
        return 1;
    }
    if (!st.visual) {
        return 0;
    }
    // generated positions of this block start after the prompt
    const int32_t first = std::max<int32_t>(0, st.n_prompt - block_start);
    if (st.tty) {
        if (!st.block_open) {
            fputs("\0337", stdout); // save the cursor where the block starts
            st.block_open = true;
        }
        fputs("\0338\033[J", stdout); // back to the block start, clear below
        fputs(render_block(st, canvas, block_size, first).c_str(), stdout);
        fflush(stdout);
    } else {
        fprintf(stderr, "[block @%d, %d masked] %s\n", block_start, n_masked,
                render_block(st, canvas, block_size, first).c_str());
    }
    return 0;
}

int on_block(int32_t /*block_start*/, const int32_t * tokens, int32_t n, void * ud) {
    auto & st = *static_cast<cli_state *>(ud);
    flush_echo(st);
    if (st.tty && st.block_open) {
        fputs("\0338\033[J", stdout); // replace the live view by the final text
        st.block_open = false;
    }
    std::string text;
    for (int32_t i = 0; i < n; ++i) {
        text += piece(st.model, tokens[i]);
    }
    return emit(st, text) || g_interrupted ? 1 : 0;
}

} // namespace

int main(int argc, char ** argv) {
    signal(SIGINT, on_sigint);
    signal(SIGPIPE, SIG_IGN); // a closed pipe or a lost RPC server is an error return, not a kill
    std::string model_path, prompt, prompt_file, grammar, grammar_file, json_schema, json_schema_file;
    bool        have_prompt = false, parse_special = true;
    int         verbose     = 0;
    clover_model_params    mp = clover_model_default_params();
    clover_context_params  cp = clover_context_default_params();
    clover_generate_params gp = clover_generate_default_params();
    bool                   auto_block = true;
    std::string            rpc_servers;
    std::string            overrides; // -ot, repeatable
    std::vector<float>     split;
    // llama.cpp's sampler chain: llama-cli's flags -> clover_generate_params
    const std::pair<const char *, double *> chain_doubles[] = {
        { "--min-p", &gp.min_p }, { "--typical", &gp.typical_p }, { "--top-nsigma", &gp.top_n_sigma },
        { "--top-n-sigma", &gp.top_n_sigma }, { "--xtc-probability", &gp.xtc_probability },
        { "--xtc-threshold", &gp.xtc_threshold }, { "--repeat-penalty", &gp.repeat_penalty },
        { "--presence-penalty", &gp.presence_penalty }, { "--frequency-penalty", &gp.frequency_penalty },
        { "--dry-multiplier", &gp.dry_multiplier }, { "--dry-base", &gp.dry_base },
        { "--mirostat-lr", &gp.mirostat_eta }, { "--mirostat-ent", &gp.mirostat_tau },
        { "--dynatemp-range", &gp.dynatemp_range }, { "--dynatemp-exp", &gp.dynatemp_exponent },
    };
    const std::pair<const char *, int32_t *> chain_ints[] = {
        { "--repeat-last-n", &gp.repeat_last_n }, { "--dry-allowed-length", &gp.dry_allowed_length },
        { "--dry-penalty-last-n", &gp.dry_penalty_last_n }, { "--mirostat", &gp.mirostat },
        { "--min-keep", &gp.min_keep },
    };
    auto chain_double = [&](const std::string & a) -> double * {
        for (const auto & f : chain_doubles) {
            if (a == f.first) {
                return f.second;
            }
        }
        return nullptr;
    };
    auto chain_int = [&](const std::string & a) -> int32_t * {
        for (const auto & f : chain_ints) {
            if (a == f.first) {
                return f.second;
            }
        }
        return nullptr;
    };
    std::vector<std::string>  breakers;
    std::vector<const char *> breaker_ptrs;
    std::vector<int32_t>      bias_tokens;
    std::vector<float>        bias;
    std::string               samplers;
    cp.n_threads = 0; // from the hardware, as `clover run` does
    gp.max_tokens = DEFAULT_N_PREDICT;
    // as `clover run`: greedy by default (the same command prints the same text; README,
    // "Command-line defaults"), the prompt echoed as llama-cli does, -n -1 = until EOS or the
    // end of the context
    bool echo = true;
    cli_state              st;

    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto val = [&](void) -> const char * {
            if (i + 1 >= argc) {
                die("option " + a + " needs a value");
            }
            return argv[++i];
        };
        if (a == "-h" || a == "--help") {
            usage(argv[0]);
            return 0;
        } else if (a == "-m" || a == "--model") {
            model_path = val();
        } else if (a == "-p" || a == "--prompt") {
            prompt      = val();
            have_prompt = true;
        } else if (a == "-f" || a == "--file") {
            prompt_file = val();
        } else if (a == "-n" || a == "--n-predict") {
            gp.max_tokens = (int32_t) parse_int(a, val(), -1, 1 << 24);
        } else if (a == "-t" || a == "--threads") {
            cp.n_threads = (int32_t) parse_int(a, val(), 1, 512);
        } else if (a == "-c" || a == "--ctx-size") {
            cp.n_ctx = (int32_t) parse_int(a, val(), 0, 1 << 24); // (0: the model's training context)
        } else if (a == "-ngl" || a == "--n-gpu-layers") {
            mp.n_gpu_layers = (int32_t) parse_int(a, val(), -1, 100000);
        } else if (a == "-r" || a == "--reverse-prompt") {
            st.stops.emplace_back(val());
            if (st.stops.back().empty()) {
                die("option " + a + " needs a non-empty text");
            }
        } else if (a == "-ot" || a == "--override-tensor") {
            overrides = overrides.empty() ? std::string(val()) : overrides + "," + val();
        } else if (a == "--rpc") {
            rpc_servers = val();
        } else if (a == "-ts" || a == "--tensor-split") {
            const std::string v = val();
            split.clear();
            size_t start = 0;
            while (start <= v.size()) {
                const size_t end = v.find_first_of(",/", start);
                const std::string part = v.substr(start, end == std::string::npos ? std::string::npos : end - start);
                const double x = parse_double(a, part.c_str());
                if (!(x >= 0.0) || !std::isfinite(x)) {
                    die("option " + a + ": shares must be finite and >= 0, got '" + part + "'");
                }
                split.push_back((float) x);
                if (end == std::string::npos) {
                    break;
                }
                start = end + 1;
            }
        } else if (a == "--block-size") {
            const std::string v = val();
            auto_block        = v == "auto";
            cp.block_size     = auto_block ? CLOVER_BLOCK_SIZE_TRAIN : (int32_t) parse_int(a, v.c_str(), 1, 1 << 20);
        } else if (a == "--draft-self" || a.rfind("--draft-self=", 0) == 0) {
            // an optional value, as clover run's: --draft-self alone = on; --draft-self auto |
            // --draft-self=auto = CLOVER_DRAFT_SELF_AUTO (the mode chosen per block with auto B)
            std::string v = "on";
            if (a.size() > 12) {
                v = a.substr(13);
            } else if (i + 1 < argc && (!strcmp(argv[i + 1], "on") || !strcmp(argv[i + 1], "off") ||
                                        !strcmp(argv[i + 1], "auto"))) {
                v = argv[++i];
            }
            if (v == "on") {
                gp.draft_self = 1;
            } else if (v == "off") {
                gp.draft_self = 0;
            } else if (v == "auto") {
                gp.draft_self = CLOVER_DRAFT_SELF_AUTO;
            } else {
                die("option --draft-self: expected on, off or auto, got '" + v + "'");
            }
        } else if (a == "--grammar") {
            grammar = val();
        } else if (a == "--grammar-file") {
            grammar_file = val();
        } else if (a == "-j" || a == "--json-schema") {
            json_schema = val();
        } else if (a == "-jf" || a == "--json-schema-file") {
            json_schema_file = val();
        } else if (a == "--threshold") {
            gp.threshold = parse_double(a, val()); // (its range: clover_generate_params_check below)
        } else if (a == "--step-cap" || a == "--max-steps") { // (the ranges: clover_generate_params_check below)
            gp.max_steps = (int32_t) parse_int(a, val(), INT32_MIN, INT32_MAX);
        } else if (a == "--temp") {
            gp.temperature = parse_double(a, val());
        } else if (a == "--top-k") {
            gp.top_k = (int32_t) parse_int(a, val(), INT32_MIN, INT32_MAX);
        } else if (a == "--top-p") {
            gp.top_p = parse_double(a, val()); // (0 = the most probable token only, as the library)
        } else if (chain_double(a)) {
            *chain_double(a) = parse_double(a, val()); // (the ranges: clover_generate_params_check below)
        } else if (chain_int(a)) {
            *chain_int(a) = (int32_t) parse_int(a, val(), INT32_MIN, INT32_MAX);
        } else if (a == "--dry-sequence-breaker") {
            breakers.push_back(val());
        } else if (a == "-l" || a == "--logit-bias") {
            const std::string v  = val();
            const size_t      at = v.find_first_of("+-", 1);
            if (at == std::string::npos) {
                die("option " + a + " expects TOKEN(+|-)BIAS, got '" + v + "'");
            }
            bias_tokens.push_back((int32_t) parse_int(a, v.substr(0, at).c_str(), 0, INT32_MAX));
            const std::string b = v.substr(at); // ("-inf" bans the token, as llama-cli)
            bias.push_back(b == "-inf" ? -std::numeric_limits<float>::infinity() : (float) parse_double(a, b.c_str()));
        } else if (a == "--samplers" || a == "--sampling-seq" || a == "--sampler-seq") {
            samplers = val();
        } else if (a == "-s" || a == "--seed") {
            const char * v   = val();
            char *       end = nullptr;
            errno            = 0;
            if (std::string(v) == "-1") { // as in llama.cpp: a random seed
                gp.seed = std::random_device{}() | ((uint64_t) std::random_device{}() << 32);
            } else {
                gp.seed = strtoull(v, &end, 10);
                if (errno || !end || *end || end == v || v[0] == '-') {
                    die("option " + a + " expects a non-negative integer or -1, got '" + v + "'");
                }
            }
        } else if (a == "--coreset") { // (its range: clover_context_new's check)
            const std::string v = val();
            cp.coreset = v == "model" ? CLOVER_CORESET_MODEL
                       : v == "auto"  ? CLOVER_CORESET_AUTO
                       : v == "off"   ? 0
                                      : (int32_t) parse_int(a, v.c_str(), INT32_MIN, INT32_MAX);
        } else if (a == "--expert-stats") {
            cp.expert_stats = 1;
        } else if (a == "-fa" || a == "--flash-attn") {
            const std::string v = val();
            if (v != "on" && v != "off" && v != "auto") {
                die("option " + a + " expects on, off or auto, got '" + v + "'");
            }
            cp.flash_attn = v == "on" ? 1 : v == "off" ? 0 : -1;
        } else if (a == "--ignore-eos" || a == "--no-stop-at-eos") {
            gp.stop_at_eos = 0;
        } else if (a == "--echo") {
            echo = true;
        } else if (a == "--no-echo" || a == "--no-display-prompt") {
            echo = false;
        } else if (a == "--visual") {
            st.visual = true;
        } else if (a == "--no-special") {
            parse_special = false;
        } else if (a == "-v" || a == "--verbose") {
            ++verbose;
        } else {
            die("unknown option '" + a + "' (see --help)");
        }
    }
    if (model_path.empty()) {
        die("no model given (-m MODEL.gguf)");
    }
    for (const std::string & b : breakers) {
        breaker_ptrs.push_back(b.c_str());
    }
    gp.dry_sequence_breakers   = breaker_ptrs.empty() ? nullptr : breaker_ptrs.data();
    gp.n_dry_sequence_breakers = (int32_t) breaker_ptrs.size();
    gp.logit_bias_tokens       = bias_tokens.empty() ? nullptr : bias_tokens.data();
    gp.logit_bias              = bias.empty() ? nullptr : bias.data();
    gp.n_logit_bias            = (int32_t) bias.size();
    gp.samplers                = samplers.empty() ? nullptr : samplers.c_str();
    {   // libclover's rules for the generation options, before anything is loaded (-n -1 is resolved later)
        clover_generate_params chk = gp;
        chk.max_tokens             = std::max<int32_t>(chk.max_tokens, 0);
        char perr[256];
        if (clover_generate_params_check(&chk, perr, sizeof(perr)) != CLOVER_OK) {
            die(perr);
        }
    }
    std::vector<const char *> stop_ptrs;
    for (const auto & s : st.stops) {
        stop_ptrs.push_back(s.c_str());
    }
    st.matcher = clover_stop_matcher_new(stop_ptrs.data(), (int32_t) stop_ptrs.size());
    if (!st.matcher) {
        die("out of memory");
    }
    if (!prompt_file.empty()) {
        if (have_prompt) {
            die("give either -p or -f, not both");
        }
        std::error_code ec;
        if (std::filesystem::is_directory(prompt_file, ec)) {
            die("prompt file '" + prompt_file + "' is a folder");
        }
        std::ifstream f(prompt_file, std::ios::binary);
        if (!f) {
            die("cannot read prompt file '" + prompt_file + "'");
        }
        std::stringstream ss;
        ss << f.rdbuf();
        prompt      = ss.str();
        have_prompt = true;
    }
    if (!have_prompt) {
        die("no prompt given (-p TEXT or -f FILE)");
    }
    if (!grammar.empty() + !grammar_file.empty() + !json_schema.empty() + !json_schema_file.empty() > 1) {
        die("give one of --grammar, --grammar-file, --json-schema, --json-schema-file");
    }
    if (!grammar_file.empty()) {
        grammar = read_option_file("grammar", grammar_file);
    }
    if (!json_schema_file.empty()) {
        json_schema = read_option_file("JSON schema", json_schema_file);
    }
    if (!json_schema.empty()) {
        grammar = schema_grammar(json_schema);
    }
    if (grammar.find('\0') != std::string::npos) {
        die("the grammar contains a NUL byte");
    }
    clover_set_verbosity(verbose);
    clover_set_notices(1); // (a command line says when it measures the cost curve)

    char err[1024];
    if (!rpc_servers.empty()) {
        mp.rpc_servers = rpc_servers.c_str();
    }
    mp.tensor_split   = split.empty() ? nullptr : split.data();
    mp.tensor_overrides = overrides.empty() ? nullptr : overrides.c_str();
    mp.n_tensor_split = (int32_t) split.size();
    g_loading = 1;
    st.model  = clover_model_load(model_path.c_str(), &mp, err, sizeof(err));
    g_loading = 0;
    if (!st.model) {
        die(err);
    }
    st.mask = clover_mask_token(st.model);
    if (g_interrupted) {
        clover_model_free(st.model);
        fputs("error: interrupted\n", stderr);
        return 130;
    }
    clover_context * ctx = clover_context_new(st.model, &cp, err, sizeof(err));
    if (!ctx) {
        clover_model_free(st.model);
        die(err);
    }

    std::vector<int32_t> tokens(prompt.size() + 16);
    int32_t              n_tok = 0;
    int rc = clover_tokenize(st.model, prompt.data(), (int32_t) prompt.size(), tokens.data(), (int32_t) tokens.size(),
                             1, parse_special ? 1 : 0, &n_tok);
    if (rc == CLOVER_ERR_BUFFER_TOO_SMALL) {
        tokens.resize((size_t) n_tok);
        rc = clover_tokenize(st.model, prompt.data(), (int32_t) prompt.size(), tokens.data(), (int32_t) tokens.size(),
                             1, parse_special ? 1 : 0, &n_tok);
    }
    if (rc != CLOVER_OK) {
        clover_context_free(ctx);
        clover_model_free(st.model);
        die("tokenization failed");
    }
    tokens.resize((size_t) n_tok);
    st.n_prompt = n_tok;
    st.tty      = isatty(fileno(stdout)) != 0;

    // auto starts at the context's B (the training B); the first call re-plans
    gp.block_size = auto_block ? CLOVER_BLOCK_SIZE_AUTO : CLOVER_BLOCK_SIZE_CONTEXT;
    gp.grammar    = grammar.empty() ? nullptr : grammar.c_str();
    if (gp.max_tokens == -1) { // the rest of the context (libclover's rule: whole blocks of a fixed B)
        gp.max_tokens = clover_generate_room(ctx, &gp, n_tok);
        if (gp.max_tokens < 1) {
            const int32_t B = auto_block ? 1 : clover_block_size(ctx);
            clover_context_free(ctx);
            clover_model_free(st.model);
            die("the prompt (" + std::to_string(n_tok) + " tokens) leaves no room for a block of " +
                std::to_string(B) + " in the context (" + std::to_string(cp.n_ctx) + "); raise -c");
        }
    }
    if (echo) {
        st.echo = prompt;
    }
    gp.step_callback  = on_step;
    gp.block_callback = on_block;
    gp.user_data      = &st;

    std::vector<int32_t> out((size_t) std::max<int32_t>(gp.max_tokens, 1));
    int32_t              n_out = 0;
    clover_stats         stats;
    rc = clover_generate(ctx, tokens.data(), n_tok, &gp, out.data(), (int32_t) out.size(), &n_out, &stats, err,
                         sizeof(err));
    if (st.stopped && rc == CLOVER_ERR_CANCELLED) {
        rc = CLOVER_OK; // a reverse prompt ended it: a normal finish
    } else if (rc != CLOVER_OK && !g_interrupted && !st.started) {
        clover_context_free(ctx);
        clover_model_free(st.model);
        die(err); // refused before anything was printed (the prompt is echoed once it runs)
    } else {
        flush_echo(st); // nothing generated (-n 0, EOS first): the echo still comes
        int32_t      n    = 0;
        const char * tail = clover_stop_matcher_flush(st.matcher, &n);
        fwrite(tail ? tail : "", 1, (size_t) n, stdout);
    }
    fputs("\n", stdout);
    fflush(stdout);
    if (g_interrupted) {
        clover_context_free(ctx);
        clover_model_free(st.model);
        fputs("error: interrupted\n", stderr);
        return 130;
    }
    if (rc != CLOVER_OK) {
        clover_context_free(ctx);
        clover_model_free(st.model);
        die(err);
    }
    fprintf(stderr,
            "clover: prompt %d tok, generated %d tok, forwards %d, steps %d, tokens/forward %.2f, "
            "decode %.2f tok/s, prefill %.1f ms, block size %d%s (%d switches), mode %s\n",
            n_tok, stats.n_generated, stats.n_forward, stats.n_steps, stats.tokens_per_forward,
            stats.tokens_per_second, stats.t_prefill_ms, stats.block_size, auto_block ? " (auto)" : "",
            stats.n_block_switches, mode_name(stats.mode));
    if ((stats.n_blocks_ar > 0) + (stats.n_blocks_diffusion > 0) + (stats.n_blocks_draft_self > 0) > 1) {
        fprintf(stderr, "clover: blocks per mode: %d autoregressive, %d diffusion, %d draft-self\n",
                stats.n_blocks_ar, stats.n_blocks_diffusion, stats.n_blocks_draft_self);
    }
    if (stats.grammar_mode != 0) {
        fprintf(stderr, "clover: grammar: %s\n",
                stats.grammar_mode == 1 ? "decoded at block size 1 (autoregressive)" : "verified by draft-self");
    }
    if (cp.expert_stats && stats.n_expert_passes > 0) {
        fprintf(stderr, "clover: experts: %.2f distinct routed experts per MoE layer of a block pass (%d passes), "
                        "%.1f MiB of expert weights a pass, %.2fx a B = 1 step's\n",
                stats.experts_per_pass, stats.n_expert_passes, stats.expert_bytes_per_pass / 1048576.0,
                stats.expert_bytes_b1 > 0 ? stats.expert_bytes_per_pass / stats.expert_bytes_b1 : 0.0);
    }
    if (gp.draft_self == 1 || stats.n_verifications > 0) {
        fprintf(stderr, "clover: draft-self: %d verifications, %d of %d drafted tokens accepted (%.2f tokens per verification)\n",
                stats.n_verifications, stats.n_accepted, stats.n_drafted, stats.tokens_per_verification);
    }
    clover_context_free(ctx);
    clover_model_free(st.model);
    clover_stop_matcher_free(st.matcher);
    return 0;
}
