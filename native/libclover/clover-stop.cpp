// clover-stop.cpp - stop strings (clover_stop_matcher): the output is cut before the first of
// them, which may span the pieces it arrives in, so text that could still begin one is held
// back until the next piece decides. The one matcher clover-cli and the Python bindings use.

#include "clover-impl.h"

struct clover_stop_matcher {
    std::vector<std::string> stops;   // the non-empty stop strings
    std::string              held;    // text that could begin a stop string
    std::string              out;     // the last call's final text
    bool                     hit = false;
};

extern "C" {

clover_stop_matcher * clover_stop_matcher_new(const char * const * stops, int32_t n_stops) {
    if (n_stops < 0 || (n_stops > 0 && !stops)) {
        return nullptr;
    }
    try {
        auto * m = new clover_stop_matcher();
        for (int32_t i = 0; i < n_stops; ++i) {
            if (stops[i] && stops[i][0]) {
                m->stops.emplace_back(stops[i]);
            }
        }
        return m;
    } catch (...) {
        return nullptr;
    }
}

void clover_stop_matcher_free(clover_stop_matcher * m) { delete m; }

const char * clover_stop_matcher_feed(clover_stop_matcher * m, const char * text, int32_t len, int32_t * n_out) {
    if (n_out) {
        *n_out = 0;
    }
    if (!m || len < 0 || (len > 0 && !text)) {
        return nullptr;
    }
    try {
        m->out.clear();
        if (m->hit) {
            return m->out.c_str();
        }
        m->held.append(text, (size_t) len);
        const std::string & t   = m->held;
        size_t              cut = std::string::npos, keep = 0;
        for (const auto & s : m->stops) {
            cut = std::min(cut, t.find(s));
        }
        if (cut != std::string::npos) {
            m->out.assign(t, 0, cut);
            m->held.clear();
            m->hit = true;
        } else {
            // hold back the longest tail that is a proper prefix of a stop string
            for (const auto & s : m->stops) {
                for (size_t k = std::min(s.size() - 1, t.size()); k > keep; --k) {
                    if (t.compare(t.size() - k, k, s, 0, k) == 0) {
                        keep = k;
                        break;
                    }
                }
            }
            m->out.assign(t, 0, t.size() - keep);
            m->held.erase(0, t.size() - keep);
        }
        if (n_out) {
            *n_out = (int32_t) m->out.size();
        }
        return m->out.c_str();
    } catch (...) {
        return nullptr;
    }
}

const char * clover_stop_matcher_flush(clover_stop_matcher * m, int32_t * n_out) {
    if (n_out) {
        *n_out = 0;
    }
    if (!m) {
        return nullptr;
    }
    m->out.swap(m->held);
    m->held.clear();
    if (m->hit) {
        m->out.clear();
    }
    if (n_out) {
        *n_out = (int32_t) m->out.size();
    }
    return m->out.c_str();
}

int32_t clover_stop_matcher_hit(const clover_stop_matcher * m) { return m && m->hit ? 1 : 0; }

} // extern "C"
