// clover-grammar.cpp - constrained decoding by a GBNF grammar: the check a grammar passes before
// llama.cpp's engine gets it, and a call's token choice under it, draft-self's clone included
// (gen_grammar, declared in clover-grammar.h; spec/decoding.md, "Grammar").

#include "clover-impl.h"
#include "clover-grammar.h"

#include <cctype>
#include <map>

// llama.cpp's grammar parser (llama_grammar_parser, exported by libllama; not in its public headers:
// llama.cpp's own tests include it the same way, from the tree's src/, which is on our include path:
// CLOVER_LLAMA_DIR, wherever the tree is)
#include "llama-grammar.h"

namespace clover_impl {

namespace {

// Bounds a grammar is held to before llama.cpp's engine sees it (docs/server.md, "Grammar limits"):
// its text, the groups llama.cpp's parser nests recursively (past them the stack overflows), its
// rules, its size once every repetition is written out (the parser copies a repeated item), and
// the readings of one character the engine follows at once (one parse stack each, every one
// expanded again after each character and run over the vocabulary at each token: hundreds hold a
// slot for minutes); the ways a rule begins (the engine's set-up compares each stack with all the
// others) and the places a rule's first character can be, over all rules.
constexpr int      k_max_depth    = 500, k_max_rules = 5000;
constexpr size_t   k_max_bytes    = 1 << 20;  // (a JSON schema's grammar is a few KB)
constexpr uint64_t k_max_symbols  = 1 << 22;  // written out: 32 MB of llama_grammar_element
constexpr uint64_t k_max_readings = 64;
constexpr uint64_t k_max_endings  = 256;    // (the same over all characters)
constexpr uint64_t k_max_stacks   = 8192;     // (10,000 alternatives: 0.5 s to set up, 60,000: 18 s)
constexpr size_t   k_max_places   = 1 << 20;

uint64_t sat_add(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }
uint64_t sat_mul(uint64_t a, uint64_t b) { return b && a > UINT64_MAX / b ? UINT64_MAX : a * b; }
bool is_word(char c) { return isalnum((unsigned char) c) || c == '-'; }

// a repetition's counts at p ("{m}", "{m,}", "{m,n}", spaces allowed), past its '}'; false when it
// is not one (llama.cpp's parser says why)
bool read_counts(const char *& p, uint64_t & min, uint64_t & max) {
    auto space  = [&] { while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') { ++p; } };
    auto number = [&](uint64_t & v) {
        if (!isdigit((unsigned char) *p)) {
            return false;
        }
        for (v = 0; isdigit((unsigned char) *p); ++p) {
            v = sat_add(sat_mul(v, 10), (uint64_t) (*p - '0'));
        }
        return true;
    };
    ++p;
    space();
    if (!number(min)) {
        return false;
    }
    space();
    max = min;
    if (*p == ',') {
        ++p;
        space();
        max = UINT64_MAX;
        number(max);
        space();
    }
    if (*p != '}') {
        return false;
    }
    ++p;
    return true;
}

// The text's checks, before llama.cpp's parser runs (it would overflow its stack, or loop without
// bound on {5,3}): a lexical scan (strings, character classes, tokens and comments skipped).
bool text_within_limits(const char * g, std::string & msg) {
    const size_t n = strlen(g);
    if (n > k_max_bytes) {
        msg = "invalid grammar: " + std::to_string(n) + " bytes (at most " + std::to_string(k_max_bytes) + ")";
        return false;
    }
    int         depth = 0, max_depth = 0, rules = 0;
    std::string rule, word;
    // the size written out: every item counts its symbols; a repetition adds its copies of the item
    // before it (the last item of each open group, innermost last)
    uint64_t              symbols = 0;
    std::vector<uint64_t> last(1, 0);
    auto item = [&](uint64_t size) {
        symbols     = sat_add(symbols, size);
        last.back() = size;
    };
    for (const char * p = g; *p;) {
        const char c = *p;
        if (c == '"' || c == '[' || c == '<') {
            const char  close = c == '"' ? '"' : c == '[' ? ']' : '>';
            const char * from = p;
            for (++p; *p && *p != close; ++p) {
                if (*p == '\\' && p[1]) {
                    ++p;
                }
            }
            item(c == '<' ? 1 : (uint64_t) (p - from));
            p += *p ? 1 : 0;
        } else if (c == '#') {
            while (*p && *p != '\n') {
                ++p;
            }
        } else if (is_word(c)) {
            const char * from = p;
            while (is_word(*p)) {
                ++p;
            }
            word.assign(from, p);
            item(1);
        } else if (c == ':' && p[1] == ':' && p[2] == '=') {
            ++rules;
            rule = word;
            last.assign(1, 0);
            p += 3;
        } else if (c == '(') {
            max_depth = std::max(max_depth, ++depth);
            last.push_back(0);
            ++p;
        } else if (c == ')') {
            depth = std::max(depth - 1, 0);
            if (last.size() > 1) {
                last.pop_back();
            }
            item(1);  // a reference to the group's rule
            ++p;
        } else if (c == '|') {
            last.back() = 0;
            ++p;
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            uint64_t min = c == '+' ? 1 : 0, max = c == '?' ? 1 : UINT64_MAX;
            if (c == '{') {
                const char * at = p;
                if (!read_counts(p, min, max)) {
                    p = at + 1;
                    continue;  // (llama.cpp's parser says what is wrong)
                }
                if (min > max) {
                    msg = "invalid grammar: rule '" + rule + "': repetition " + std::string(at, p) +
                          ": its minimum is above its maximum";
                    return false;
                }
            } else {
                ++p;
            }
            // llama.cpp writes S{m,n} as m copies of S and n - m optional ones (one rule each)
            const uint64_t optional = max == UINT64_MAX ? 1 : max - min;
            const uint64_t copies   = sat_add(min ? min - 1 : 0, optional);
            symbols     = sat_add(symbols, sat_mul(sat_add(last.back(), 4), copies));
            last.back() = sat_add(sat_mul(last.back(), std::max<uint64_t>(min, 1)), 1);
        } else {
            ++p;
        }
        if (symbols > k_max_symbols) {
            msg = "invalid grammar: rule '" + rule + "': more than " + std::to_string(k_max_symbols) +
                  " symbols once its repetitions are written out";
            return false;
        }
    }
    if (max_depth > k_max_depth) {
        msg = "invalid grammar: groups nested " + std::to_string(max_depth) + " deep (at most " +
              std::to_string(k_max_depth) + ")";
        return false;
    }
    if (rules > k_max_rules) {
        msg = "invalid grammar: " + std::to_string(rules) + " rules (at most " + std::to_string(k_max_rules) + ")";
        return false;
    }
    return true;
}

// llama.cpp's parse error (logged, patch 0009), on one line
std::string parse_error() {
    std::string why = last_log_error();
    for (const char * noise : { "; failed to parse grammar", "parse: " }) {
        const size_t at = why.find(noise);
        if (at != std::string::npos && why.size() > strlen(noise)) {
            why.erase(at, strlen(noise));
        }
    }
    const size_t nl = why.find('\n');
    if (nl != std::string::npos) {
        why.erase(nl);
    }
    if (why.size() > 300) {
        why = why.substr(0, 300) + "...";
    }
    return "invalid grammar" + (why.empty() ? std::string() : ": " + why);
}

bool is_terminal(llama_gretype t) {
    return t == LLAMA_GRETYPE_CHAR || t == LLAMA_GRETYPE_CHAR_NOT || t == LLAMA_GRETYPE_CHAR_ANY ||
           t == LLAMA_GRETYPE_TOKEN || t == LLAMA_GRETYPE_TOKEN_NOT;
}

bool is_end(llama_gretype t) { return t == LLAMA_GRETYPE_END || t == LLAMA_GRETYPE_ALT; }

// The parsed rules' checks: what llama.cpp's engine cannot run. It keeps one stack per way the text
// so far can be read, and expands rule references until each stack ends at a character: a rule
// that reaches itself before any character (left recursion, or a repetition of something that can
// match nothing, ("a"?)*) grows without bound, and nested repetitions of such things multiply the
// stacks (b{0,30} with b ::= c{0,30}, c ::= "a"?: 900 readings of each "a").
struct rules_walk {
    const llama_grammar_rules & rules;
    std::vector<std::string>    names;     // the grammar's rule each (parser-made rules: "root_7" -> "root")
    std::vector<char>           nullable;  // the rule can match nothing

    explicit rules_walk(const llama_grammar_parser & p) : rules(p.rules), names(p.rules.size()), nullable(p.rules.size()) {
        for (const auto & [name, id] : p.symbol_ids) {
            if (id < names.size()) {
                names[id] = name.substr(0, name.find('_'));  // (a grammar's rule names have no '_')
            }
        }
    }

    // the fixed point, by a work list: an alternative is nullable when all its references are
    void find_nullable() {
        std::vector<std::vector<std::pair<size_t, size_t>>> used_in(rules.size());  // rule -> (rule, alt)
        std::vector<std::vector<size_t>> pending(rules.size());                      // refs not yet nullable
        std::vector<size_t>              work;
        for (size_t r = 0; r < rules.size(); r++) {
            size_t refs = 0, alt = 0;
            bool   chars = false;
            for (const auto & e : rules[r]) {
                if (e.type == LLAMA_GRETYPE_RULE_REF) {
                    refs++;
                    used_in[e.value].push_back({ r, alt });
                } else if (is_terminal(e.type)) {
                    chars = true;
                } else if (is_end(e.type)) {
                    pending[r].push_back(chars ? SIZE_MAX : refs);
                    if (!chars && refs == 0 && !nullable[r]) {
                        nullable[r] = 1;
                        work.push_back(r);
                    }
                    refs = 0, chars = false, alt++;
                }
            }
        }
        while (!work.empty()) {
            const size_t b = work.back();
            work.pop_back();
            for (const auto & [r, alt] : used_in[b]) {
                if (pending[r][alt] != SIZE_MAX && --pending[r][alt] == 0 && !nullable[r]) {
                    nullable[r] = 1;
                    work.push_back(r);
                }
            }
        }
    }

    // the references a rule can enter before reading a character (an alternative's first ones,
    // up to its first one that cannot match nothing)
    std::vector<uint32_t> left_refs(size_t r) const {
        std::vector<uint32_t> out;
        bool                  open = true;
        for (const auto & e : rules[r]) {
            if (is_end(e.type)) {
                open = true;
            } else if (open && e.type == LLAMA_GRETYPE_RULE_REF) {
                out.push_back(e.value);
                open = nullable[e.value];
            } else if (is_terminal(e.type)) {
                open = false;
            }
        }
        return out;
    }

    // rules in an order where each comes after those it enters first; false + msg on a cycle
    bool left_order(std::vector<size_t> & order, std::string & msg) const {
        std::vector<char> state(rules.size(), 0);  // 0 new, 1 on the path, 2 done
        for (size_t start = 0; start < rules.size(); start++) {
            if (state[start]) {
                continue;
            }
            std::vector<std::pair<size_t, std::vector<uint32_t>>> path;  // (rule, refs left to visit)
            path.push_back({ start, left_refs(start) });
            state[start] = 1;
            while (!path.empty()) {
                auto & [r, todo] = path.back();
                if (todo.empty()) {
                    state[r] = 2;
                    order.push_back(r);
                    path.pop_back();
                    continue;
                }
                const uint32_t next = todo.back();
                todo.pop_back();
                if (state[next] == 1) {
                    std::string cycle;
                    auto        it = std::find_if(path.begin(), path.end(), [&](auto & f) { return f.first == next; });
                    for (std::string prev; it != path.end(); ++it) {
                        if (names[it->first] != prev) {  // (a rule's parser-made rules as the rule once)
                            prev = names[it->first];
                            cycle += prev + " -> ";
                        }
                    }
                    msg = "invalid grammar: rule '" + names[next] + "' can come back to itself before reading a "
                          "character (" + cycle + names[next] + "): left recursion, or a repetition of "
                          "something that can match nothing such as (\"a\"?)*, which llama.cpp's grammar engine "
                          "cannot run";
                    return false;
                }
                if (state[next] == 0) {
                    state[next] = 1;
                    path.push_back({ next, left_refs(next) });
                }
            }
        }
        return true;
    }

    // The stacks that entering each rule gives (one per way to reach a character), and among them
    // those whose character ends its alternative, per character: after it such a stack falls back
    // to the ways below it and is expanded again, so one character read in many such ways
    // multiplies the work at every character (b{0,30} of c{0,30}, c ::= "a"?: "a" in 900 ways).
    // (An enum's alternatives all begin with '"' but go on in their own ways.) False + msg past
    // k_max_stacks ways for a rule, k_max_readings for a character (k_max_endings over all), or
    // k_max_places entries in the per-character counts over all rules.
    bool readings_within_limit(const std::vector<size_t> & order, std::string & msg) const {
        // ends_alt[r][i]: all of rule r from element i to its alternative's end can match nothing
        std::vector<std::vector<char>> ends_alt(rules.size());
        for (size_t r = 0; r < rules.size(); r++) {
            const auto & rule = rules[r];
            ends_alt[r].assign(rule.size() + 1, 1);
            for (size_t i = rule.size(); i-- > 0;) {
                const auto t = rule[i].type;
                ends_alt[r][i] = is_end(t)                      ? 1 :
                                 t == LLAMA_GRETYPE_RULE_REF    ? nullable[rule[i].value] && ends_alt[r][i + 1] :
                                 is_terminal(t)                 ? 0 :
                                                                  ends_alt[r][i + 1];  // (the rest of a class)
            }
        }
        auto character = [&](uint64_t at) {  // the element's character (class) as a key
            const auto & rule = rules[at >> 32];
            std::string  key;
            for (size_t i = at & 0xffffffff; i < rule.size(); i++) {
                if (!key.empty() && rule[i].type != LLAMA_GRETYPE_CHAR_ALT && rule[i].type != LLAMA_GRETYPE_CHAR_RNG_UPPER) {
                    break;
                }
                key.append((const char *) &rule[i], sizeof(rule[i]));
            }
            return key;
        };
        std::vector<uint64_t>                        ways(rules.size());  // rule -> its stacks on entry
        std::vector<std::map<std::string, uint64_t>> ending(rules.size());  // rule -> (character -> ways)
        size_t                                       places = 0;  // (over all rules' ending maps)
        for (size_t r : order) {  // (each rule after those its alternatives enter first)
            auto & mine = ending[r];
            bool   open = true;   // on the alternative's leading part that can match nothing
            for (size_t i = 0; i < rules[r].size(); i++) {
                const auto & e = rules[r][i];
                if (is_end(e.type)) {
                    open = true;
                } else if (open && is_terminal(e.type)) {
                    ways[r] = sat_add(ways[r], 1);
                    if (ends_alt[r][i + 1]) {
                        auto & n = mine[character((uint64_t) r << 32 | i)];
                        n        = sat_add(n, 1);
                    }
                    open = false;
                } else if (open && e.type == LLAMA_GRETYPE_RULE_REF) {
                    ways[r] = sat_add(ways[r], ways[e.value]);
                    for (const auto & [key, m] : ending[e.value]) {
                        auto & n = mine[key];
                        n        = sat_add(n, m);
                    }
                    open = nullable[e.value];
                }
            }
            if (ways[r] > k_max_stacks) {
                msg = "invalid grammar: rule '" + names[r] + "' begins in " +
                      (ways[r] == UINT64_MAX ? std::string("more than 2^64") : std::to_string(ways[r])) +
                      " ways (at most " + std::to_string(k_max_stacks) + "): llama.cpp's grammar engine makes a "
                      "stack for each and compares it with all the others";
                return false;
            }
            uint64_t all = 0;  // (and over all characters: "a"? [a-b]? [a-c]? overlap under other names)
            for (const auto & [key, n] : mine) {
                all = sat_add(all, n);
                if (n > k_max_readings || all > k_max_endings) {
                    const uint64_t    most  = n > k_max_readings ? n : all;
                    const std::string count = most == UINT64_MAX ? "more than 2^64" : std::to_string(most);
                    msg = "invalid grammar: rule '" + names[r] + "' is too ambiguous: llama.cpp's grammar engine "
                          "would follow " + (n > k_max_readings ? count + " readings of one character at once (at most " +
                          std::to_string(k_max_readings) : count + " readings of a character at once (at most " +
                          std::to_string(k_max_endings)) + "); a repetition of something that can match nothing, as "
                          "b{0,30} with b ::= \"a\"?, is the usual cause";
                    return false;
                }
            }
            places += mine.size();
            if (places > k_max_places) {
                msg = "invalid grammar: rule '" + names[r] + "': more than " + std::to_string(k_max_places) +
                      " characters that end an alternative where a rule begins, over all rules";
                return false;
            }
        }
        return true;
    }
};

}  // namespace

bool grammar_check(const char * grammar, const char * root, const llama_vocab * vocab, std::string & msg) {
    if (!text_within_limits(grammar, msg)) {
        return false;
    }
    llama_grammar_parser parser(vocab);
    g_last_log_error.clear();
    if (!parser.parse(grammar) || parser.rules.empty()) {
        msg = parse_error();
        return false;
    }
    const auto at_root = parser.symbol_ids.find(root);
    if (at_root == parser.symbol_ids.end()) {
        return true;  // (llama_sampler_init_grammar says so)
    }
    rules_walk          walk(parser);
    std::vector<size_t> order;
    walk.find_nullable();
    return walk.left_order(order, msg) && walk.readings_within_limit(order, msg);
}

gen_grammar::~gen_grammar() {
    if (draft) {
        llama_sampler_free(draft);
    }
    if (smpl) {
        llama_sampler_free(smpl);
    }
}

bool gen_grammar::forces_ar(const clover_generate_params & gp) {
    return (gp.grammar && gp.grammar[0] && gp.draft_self != 1) || // (draft_self auto included)
           sampler_chain::forces_ar(gp);
}

int gen_grammar::init(const clover_context * ctx, const clover_generate_params & gp, const int32_t * prompt,
                      int32_t n_prompt, std::string & msg) {
    const clover_model * m = ctx->model;
    model      = m;
    if (chain.init(m, gp, ctx->n_ctx, msg) != CLOVER_OK) {
        return CLOVER_ERR_INVALID_ARG;
    }
    for (int32_t i = 0; i < n_prompt; ++i) { // (llama-completion and llama-server count the prompt too)
        chain.accept(prompt[i]);
    }
    draft_self = gp.draft_self == 1;
    if (gp.grammar && gp.grammar[0]) {
        const char * root = gp.grammar_root && gp.grammar_root[0] ? gp.grammar_root : "root";
        if (!grammar_check(gp.grammar, root, m->vocab, msg)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        g_last_log_error.clear();
        smpl = llama_sampler_init_grammar(m->vocab, gp.grammar, root);
        if (!smpl) {
            msg = parse_error();
            return CLOVER_ERR_INVALID_ARG;
        }
        cur.resize(m->n_vocab);
        constrained.resize(m->n_vocab);
    }
    return CLOVER_OK;
}

bool gen_grammar::allows(llama_sampler * g, int32_t tok) const {
    if (model->eos >= 0 && tok != model->eos && llama_vocab_is_eog(model->vocab, tok)) {
        return false; // the output ends at EOS only (an end-of-turn token would not stop it)
    }
    llama_token_data       one{ tok, 0.0f, 0.0f };
    llama_token_data_array arr{ &one, 1, -1, false };
    llama_sampler_apply(g, &arr);
    return one.logit != -std::numeric_limits<float>::infinity();
}

void gen_grammar::choose(const float * row, const clover_generate_params & gp, std::mt19937_64 & rng,
                         pick_work & w, int32_t & tok, double & conf) {
    if (!chain.on()) {
        pick_candidate(row, model->n_vocab, model->mask, gp.temperature, gp.top_k, gp.top_p, rng, w, tok, conf);
        return;
    }
    if (step_stale && !verifying) { // the history of a step: committed + the canvas's unmasked tokens
        chain.begin_step(canvas_tok);
        step_stale = false;
    }
    chain.choose(row, !verifying, gp, rng, w, tok, conf);
}

// a token into a grammar sampler; llama.cpp's refusal of it (its parse grew past its bound of
// alternative stacks: an ambiguous grammar whose readings multiply) ends the generation, one line
static void grammar_accept(llama_sampler * g, int32_t tok) {
    try {
        llama_sampler_accept(g, tok);
    } catch (const std::runtime_error & e) {
        throw input_error(std::string("grammar: ") + e.what());
    }
}

void gen_grammar::accept(int32_t tok) {
    chain.accept(tok);
    step_stale = true;
    if (smpl && allows(smpl, tok)) { // (a token the grammar refuses is only ever the stuck case's EOS)
        grammar_accept(smpl, tok);
    }
}

void gen_grammar::pick(const float * row, bool next, const clover_generate_params & gp, std::mt19937_64 & rng,
                       pick_work & w, int32_t & tok, double & conf) {
    if (!smpl || !next) {
        choose(row, gp, rng, w, tok, conf);
        return;
    }
    pick_in(smpl, row, gp, rng, w, tok, conf);
}

void gen_grammar::pick_at(const float * row, int32_t p, const clover_generate_params & gp, std::mt19937_64 & rng,
                          pick_work & w, int32_t & tok, double & conf) {
    if (!smpl || p == 0 || !draft_self) { // (without draft-self a grammar runs at B = 1: p is 0)
        pick(row, p == 0, gp, rng, w, tok, conf);
        if (smpl && draft_self) { // a new step of the draft (its positions come in order)
            note_candidate(0, tok);
        }
        return;
    }
    // a draft position: the grammar, run (on a copy) over the draft before it - the tokens
    // already unmasked and this step's candidates of the masked ones - constrains it too, so that
    // the draft stays in the grammar and can be accepted (the verification decides either way)
    if (p <= draft_n - 1 || !draft) { // a new step: start again from the grammar's state
        if (draft) {
            llama_sampler_free(draft);
        }
        draft      = llama_sampler_clone(smpl);
        draft_n    = 0;
        draft_dead = false;
    }
    for (; !draft_dead && draft_n < p; ++draft_n) {
        const int32_t t = draft_n < (int32_t) canvas_tok.size() && canvas_tok[draft_n] >= 0 ? canvas_tok[draft_n]
                          : draft_n < (int32_t) step_cand.size()                            ? step_cand[draft_n]
                                                                                             : -1;
        if (t < 0 || !allows(draft, t)) {
            draft_dead = true; // the draft already left the grammar: the rest of this step is free
            break;
        }
        grammar_accept(draft, t);
    }
    if (draft_dead) {
        pick(row, false, gp, rng, w, tok, conf);
    } else {
        pick_in(draft, row, gp, rng, w, tok, conf);
    }
    note_candidate(p, tok);
}

void gen_grammar::note_candidate(int32_t p, int32_t tok) {
    if ((int32_t) step_cand.size() <= p) {
        step_cand.resize(p + 1, -1);
    }
    step_cand[p] = tok;
    if (p == 0) {
        draft_n = 0; // (position 0 is the grammar's own next position: the draft copy restarts)
        if (draft) {
            llama_sampler_free(draft);
            draft = nullptr;
        }
        draft_dead = false;
    }
}

void gen_grammar::pick_in(llama_sampler * g, const float * row, const clover_generate_params & gp,
                          std::mt19937_64 & rng, pick_work & w, int32_t & tok, double & conf) {
    const int32_t V = model->n_vocab;
    if (gp.temperature == 0.0) { // greedy: the free argmax, when the grammar allows it, is the constrained one
        choose(row, gp, rng, w, tok, conf);
        if (allows(g, tok)) {
            return;
        }
    }
    for (int32_t i = 0; i < V; ++i) {
        cur[i] = llama_token_data{ i, row[i], 0.0f };
    }
    llama_token_data_array arr{ cur.data(), (size_t) V, -1, false };
    llama_sampler_apply(g, &arr);
    bool any = false;
    for (int32_t i = 0; i < V; ++i) {
        const bool other_end = model->eos >= 0 && i != model->eos && llama_vocab_is_eog(model->vocab, i);
        constrained[i]       = other_end ? -std::numeric_limits<float>::infinity() : cur[i].logit;
        any = any || (i != model->mask && constrained[i] > -std::numeric_limits<float>::infinity());
    }
    if (!any) { // no token of the vocabulary continues the grammar: the output ends here, as at EOS
        if (model->eos < 0) {
            throw std::runtime_error("grammar: no token of the vocabulary can continue the output, and the model "
                                     "has no EOS token");
        }
        tok  = model->eos;
        conf = 1.0;
        w.p.assign(V, 0.0); // the distribution it was chosen from (draft-self's acceptance reads it)
        w.p[tok] = 1.0;
        return;
    }
    choose(constrained.data(), gp, rng, w, tok, conf);
}

void gen_grammar::unmasked(int32_t p, int32_t tok) {
    // (the block's tokens are final only at take_block: a draft-self canvas is a draft)
    if ((int32_t) canvas_tok.size() <= p) {
        canvas_tok.resize(p + 1, -1);
    }
    canvas_tok[p] = tok;
    step_stale    = true;
}

void gen_grammar::block_from_canvas(int32_t n) {
    n = std::min<int32_t>(n, (int32_t) canvas_tok.size());
    block_tok.assign(canvas_tok.begin(), canvas_tok.begin() + n);
    block_verified = false;
}

void gen_grammar::verify_begin() {
    verifying = true;
    block_tok.clear();
    block_verified = true;
}

void gen_grammar::verified(int32_t tok) {
    block_tok.push_back(tok);
    accept(tok); // the verification's next position is constrained given this one
}

void gen_grammar::take_block() {
    if (!block_verified) { // a block decoded without a verification (block size 1): the grammar takes it now
        for (int32_t t : block_tok) {
            accept(t);
        }
    }
    block_tok.clear();
    block_verified = false;
    verifying      = false;
    step_stale     = true;
    std::fill(canvas_tok.begin(), canvas_tok.end(), -1);
    if (draft) { // the next block's draft starts from the grammar's state after this block
        llama_sampler_free(draft);
        draft = nullptr;
    }
    draft_n    = 0;
    draft_dead = false;
    std::fill(step_cand.begin(), step_cand.end(), -1);
}

void gen_grammar::report(clover_stats * stats) const {
    if (stats) {
        stats->grammar_mode = !smpl ? 0 : draft_self ? 2 : 1;
    }
}

} // namespace clover_impl
