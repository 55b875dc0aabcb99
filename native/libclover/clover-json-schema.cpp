// clover-json-schema.cpp - clover_json_schema_to_grammar: a JSON schema as GBNF by llama.cpp's own
// converter (common/json-schema-to-grammar.cpp, what llama-server runs for json_schema and
// response_format).
//
// The converter enforces a subset of JSON Schema and passes over the rest in silence: a number's
// minimum, multipleOf, not, format "email", a oneOf read as anyOf, a keyword beside $ref, an
// unanchored pattern (any string, with a warning on stderr). So every keyword is checked first
// against what the converter does with it at that place (keyword_check mirrors the decisions of
// common_chat_schema_from_json in common/json-schema.cpp), and one it would not enforce is refused
// with its name and path: the grammar never admits a value the schema rejects, save the day of
// the month of a "date", which llama.cpp's date rule takes as 01-31 whatever the month.

#include "clover-impl.h"
#include "clover-grammar.h"

#include "common.h"  // string_split, as the converter splits a $ref
#include "json-schema-to-grammar.h"
#include "json-schema.h"
#include "json.h"

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

namespace {

using json = common_json;

struct schema_refusal : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// keywords that do not bear on which values are valid: annotations, and where subschemas are kept
const std::set<std::string> k_annotations = {
    "title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$defs", "definitions",
};

// the formats llama.cpp's converter writes (json-schema.cpp, get_format)
const std::set<std::string> k_formats = { "date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5" };

// JSON value types as bits (a number type admits integers too)
enum : uint32_t {
    T_NULL = 1, T_BOOLEAN = 2, T_INTEGER = 4, T_FRACTION = 8, T_STRING = 16, T_ARRAY = 32, T_OBJECT = 64,
    T_NUMBER = T_INTEGER | T_FRACTION, T_ALL = 127,
};

// keywords that JSON Schema applies to values of one type only (on other values they hold)
const std::map<std::string, uint32_t> k_type_keywords = {
    {"minimum", T_NUMBER}, {"maximum", T_NUMBER}, {"exclusiveMinimum", T_NUMBER}, {"exclusiveMaximum", T_NUMBER},
    {"multipleOf", T_NUMBER},
    {"minLength", T_STRING}, {"maxLength", T_STRING}, {"pattern", T_STRING}, {"format", T_STRING},
    {"contentEncoding", T_STRING}, {"contentMediaType", T_STRING}, {"contentSchema", T_STRING},
    {"items", T_ARRAY}, {"prefixItems", T_ARRAY}, {"additionalItems", T_ARRAY}, {"unevaluatedItems", T_ARRAY},
    {"minItems", T_ARRAY}, {"maxItems", T_ARRAY}, {"uniqueItems", T_ARRAY}, {"contains", T_ARRAY},
    {"minContains", T_ARRAY}, {"maxContains", T_ARRAY},
    {"properties", T_OBJECT}, {"required", T_OBJECT}, {"additionalProperties", T_OBJECT},
    {"patternProperties", T_OBJECT}, {"unevaluatedProperties", T_OBJECT}, {"propertyNames", T_OBJECT},
    {"minProperties", T_OBJECT}, {"maxProperties", T_OBJECT}, {"dependentRequired", T_OBJECT},
    {"dependentSchemas", T_OBJECT}, {"dependencies", T_OBJECT},
};

// schemas nested deeper than this are refused: the converter recurses once per level
constexpr int k_max_depth = 64;

// integer bounds the converter writes exactly (build_min_max_int writes at most 16 digits)
constexpr double k_max_bound = 1e15;

// llama.cpp's grammar parser refuses a repetition past this many times and reads a larger upper
// bound as none at all (llama-grammar.cpp, MAX_REPETITION_THRESHOLD): counts above it are refused
constexpr int64_t k_max_repeat = 2000;

uint32_t type_bits(const std::string & name) {
    static const std::map<std::string, uint32_t> bits = {
        {"null", T_NULL}, {"boolean", T_BOOLEAN}, {"integer", T_INTEGER}, {"number", T_NUMBER},
        {"string", T_STRING}, {"array", T_ARRAY}, {"object", T_OBJECT},
    };
    auto it = bits.find(name);
    return it == bits.end() ? 0 : it->second;
}

uint32_t value_bits(const json & v) {
    if (v.is_null())           { return T_NULL; }
    if (v.is_boolean())        { return T_BOOLEAN; }
    if (v.is_number_integer()) { return T_INTEGER; }
    if (v.is_number())         { return T_FRACTION; }
    if (v.is_string())         { return T_STRING; }
    if (v.is_array())          { return T_ARRAY; }
    return T_OBJECT;
}

// the types of a const's value or of an enum's values
uint32_t values_bits(const json & v, const std::string & key) {
    if (key == "const") {
        return value_bits(v);
    }
    uint32_t bits = 0;
    for (size_t i = 0; v.is_array() && i < v.size(); i++) {
        bits |= value_bits(v.at(i));
    }
    return v.is_array() ? bits : T_ALL;
}

std::string quoted(const std::string & key) { return "'" + key + "'"; }

class keyword_check {
  public:
    explicit keyword_check(const json & root) : root_(root) {}

    void run() { visit(root_, "#", 0); }

  private:
    const json &          root_;
    std::set<std::string> refs_seen_;

    [[noreturn]] static void refuse(const std::string & path, const std::string & key, const std::string & why) {
        throw schema_refusal("JSON schema: " + quoted(key) + " at " + path + ": " + why);
    }

    // every keyword of s must be one the converter enforces here (`used`), an annotation, or one that
    // holds vacuously on every value the grammar writes (`writes`: the types of those values)
    static void only(const json & s, const std::string & path, std::initializer_list<const char *> used,
                     const std::string & here, uint32_t writes = T_ALL) {
        for (const auto & [key, value] : s.items()) {
            (void) value;
            auto typed = k_type_keywords.find(key);
            if (k_annotations.count(key) || (typed != k_type_keywords.end() && (typed->second & writes) == 0)) {
                continue;
            }
            bool ok = false;
            for (const char * u : used) {
                ok = ok || key == u;
            }
            if (!ok) {
                refuse(path, key, "llama.cpp's grammar converter does not enforce it on " + here);
            }
        }
    }

    static bool has(const json & s, const char * key) { return s.is_object() && s.contains(key); }

    // the target of a "#/..." reference, as the converter resolves it; nullptr when it cannot
    const json * resolve(const json & ref) const {
        if (!ref.is_string()) {
            return nullptr;
        }
        const std::string r = ref.get<std::string>();
        if (r.compare(0, 2, "#/") != 0) {
            return nullptr;
        }
        const json * target = &root_;
        auto parts = string_split(r.substr(1), "/");
        for (size_t i = 1; i < parts.size(); i++) {
            if (target->is_object() && target->contains(parts[i])) {
                target = &target->at(parts[i]);
            } else if (target->is_array()) {
                size_t idx = 0;
                try {
                    idx = std::stoull(parts[i]);
                } catch (const std::logic_error &) {
                    return nullptr;
                }
                if (idx >= target->size()) {
                    return nullptr;
                }
                target = &target->at(idx);
            } else {
                return nullptr;
            }
        }
        return target;
    }

    // a schema with its $refs followed (nullptr: unresolved, or a cycle of references)
    const json * deref(const json & s) const {
        const json * at = &s;
        for (int hops = 0; has(*at, "$ref"); hops++) {
            at = hops < k_max_depth ? resolve(at->at("$ref")) : nullptr;
            if (!at) {
                return nullptr;
            }
        }
        return at;
    }

    void visit(const json & s, const std::string & path, int depth) {
        if (depth > k_max_depth) {
            throw schema_refusal("JSON schema: nested deeper than " + std::to_string(k_max_depth) + " schemas at " + path);
        }
        if (!s.is_object()) {
            return;  // the converter refuses it itself
        }
        if (s.contains("$ref")) {
            only(s, path, {"$ref"}, "a schema with $ref (it reads the reference alone)");
            const json & ref = s.at("$ref");
            const json * target = resolve(ref);
            if (target && refs_seen_.insert(ref.get<std::string>()).second) {
                visit(*target, ref.get<std::string>(), depth + 1);
            }
            return;
        }
        if (s.contains("oneOf") || s.contains("anyOf")) {
            const char * key = s.contains("oneOf") ? "oneOf" : "anyOf";
            only(s, path, {key}, std::string("a schema with ") + key + " (it reads the alternatives alone)");
            const json & alts = s.at(key);
            if (!alts.is_array()) {
                return;
            }
            for (size_t i = 0; i < alts.size(); i++) {
                visit(alts.at(i), path + "/" + key + "/" + std::to_string(i), depth + 1);
            }
            if (std::string(key) == "oneOf") {
                check_exclusive(alts, path + "/oneOf");
            }
            return;
        }
        const json type = s.contains("type") ? s.at("type") : json();
        if (type.is_array()) {  // one alternative per type, as the converter expands it
            for (size_t i = 0; i < type.size(); i++) {
                json alt = s;
                alt["type"] = type.at(i);
                visit(alt, path + "/type/" + std::to_string(i), depth + 1);
            }
            return;
        }
        if (s.contains("const") || s.contains("enum")) {
            const char * key = s.contains("const") ? "const" : "enum";
            only(s, path, {key, "type"}, std::string("a schema with ") + key + " (it writes the values alone)",
                 values_bits(s.at(key), key));
            check_values_have_type(s, key, type, path);
            return;
        }
        if (!type.is_null() && !type.is_string()) {
            return;  // the converter refuses it
        }
        const std::string type_name = type.is_string() ? type.get<std::string>() : "";
        const bool has_properties = s.contains("properties") ||
            (s.contains("additionalProperties") && s.at("additionalProperties") != true);
        if (type_name.empty()) {  // the structural keywords decide, in the converter's order
            if (has_properties) {
                return object(s, path, depth);
            }
            if (s.contains("allOf")) {
                return all_of(s, path, depth);
            }
            if (s.contains("items") || s.contains("prefixItems")) {
                return array(s, path, depth);
            }
            if (s.contains("pattern") || s.contains("minLength") || s.contains("maxLength") ||
                (s.contains("format") && s.at("format").is_string() && k_formats.count(s.at("format").get<std::string>()))) {
                return string(s, path);
            }
            return only(s, path, {}, "a schema without a type (any JSON value)");
        }
        if (type_name == "object") {
            return !has_properties && s.contains("allOf") ? all_of(s, path, depth) : object(s, path, depth);
        }
        if (type_name == "string") {
            return s.contains("allOf") ? all_of(s, path, depth) : string(s, path);
        }
        if (type_name == "array") {
            return array(s, path, depth);
        }
        if (type_name == "integer") {
            return integer(s, path);
        }
        if (type_name == "number") {
            return only(s, path, {"type"}, "a number (it bounds integers only)", T_NUMBER);
        }
        only(s, path, {"type"}, "a " + type_name, type_bits(type_name));
    }

    void check_values_have_type(const json & s, const char * key, const json & type, const std::string & path) {
        if (!type.is_string()) {
            return;
        }
        const uint32_t allowed = type_bits(type.get<std::string>());
        const json & v = s.at(key);
        bool ok = true;
        if (std::string(key) == "const") {
            ok = (value_bits(v) & allowed) != 0;
        } else if (v.is_array()) {
            for (size_t i = 0; i < v.size(); i++) {
                ok = ok && (value_bits(v.at(i)) & allowed) != 0;
            }
        }
        if (!ok) {
            refuse(path, "type", std::string("the converter writes the ") + key + " values as given, and one is not a " +
                   type.get<std::string>());
        }
    }

    void object(const json & s, const std::string & path, int depth) {
        only(s, path, {"type", "properties", "required", "additionalProperties"}, "an object", T_OBJECT);
        std::set<std::string> names;
        if (s.contains("properties") && s.at("properties").is_object()) {
            for (const auto & [name, prop] : s.at("properties").items()) {
                names.insert(name);
                visit(prop, path + "/properties/" + name, depth + 1);
            }
        }
        check_required(s, names, path);
        if (s.contains("additionalProperties") && s.at("additionalProperties").is_object()) {
            visit(s.at("additionalProperties"), path + "/additionalProperties", depth + 1);
        }
    }

    // the converter requires a property only where properties defines it, and reads only an array of names
    static void check_required(const json & s, const std::set<std::string> & names, const std::string & path) {
        if (!s.contains("required")) {
            return;
        }
        const json & req = s.at("required");
        if (!req.is_array()) {
            refuse(path, "required", "must be an array of property names");
        }
        for (size_t i = 0; i < req.size(); i++) {
            if (!req.at(i).is_string()) {
                refuse(path, "required", "must be an array of property names");
            }
            if (!names.count(req.at(i).get<std::string>())) {
                refuse(path, "required", "names " + req.at(i).get<std::string>() +
                       ", which properties does not define (the converter requires defined properties only)");
            }
        }
    }

    void array(const json & s, const std::string & path, int depth) {
        only(s, path, {"type", "items", "prefixItems", "minItems", "maxItems"}, "an array", T_ARRAY);
        if (s.contains("items") && s.contains("prefixItems")) {
            refuse(path, "prefixItems", "beside items the converter reads items alone");
        }
        const int64_t min_items = count(s, "minItems", path), max_items = count(s, "maxItems", path);
        if (max_items >= 0 && min_items > max_items) {
            refuse(path, "minItems", "above maxItems: no array is valid");
        }
        const char * key = s.contains("items") ? "items" : "prefixItems";
        if (!s.contains(key)) {
            return;
        }
        const json & items = s.at(key);
        if (items.is_array()) {  // a tuple: the converter writes exactly its items
            const auto n = (int64_t) items.size();
            if (min_items > n || (max_items >= 0 && max_items < n)) {
                refuse(path, min_items > n ? "minItems" : "maxItems",
                       "the converter writes exactly the " + std::to_string(n) + " items of the tuple");
            }
            for (size_t i = 0; i < items.size(); i++) {
                visit(items.at(i), path + "/" + key + "/" + std::to_string(i), depth + 1);
            }
        } else {
            visit(items, path + "/" + key, depth + 1);
        }
    }

    // a count keyword (minItems, minLength, ...), -1 when absent or not one (the converter refuses those)
    static int64_t count(const json & s, const char * key, const std::string & path) {
        if (!s.contains(key) || !s.at(key).is_number_integer()) {
            return -1;
        }
        if (s.at(key).get<double>() > (double) k_max_repeat) {
            refuse(path, key, "above " + std::to_string(k_max_repeat) + ", the most repetitions llama.cpp's grammar takes");
        }
        return s.at(key).get<int64_t>();
    }

    // the largest count of a {m}, {m,} or {m,n} in a pattern (0: none)
    static int64_t largest_repeat(const std::string & pattern) {
        int64_t largest = 0;
        for (size_t i = 0; i < pattern.size(); i++) {
            if (pattern[i] == '\\') {
                i++;  // an escaped character, a brace included
                continue;
            }
            if (pattern[i] != '{') {
                continue;
            }
            for (size_t j = i + 1; j < pattern.size() && pattern[j] != '}';) {  // its numbers
                const size_t end = std::min(pattern.find_first_not_of("0123456789", j), pattern.size());
                if (end == j) {
                    j++;  // the comma
                    continue;
                }
                largest = std::max(largest, end - j > 9 ? INT64_MAX : (int64_t) std::stoll(pattern.substr(j, end - j)));
                j = end;
            }
        }
        return largest;
    }

    static void string(const json & s, const std::string & path) {
        only(s, path, {"type", "pattern", "format", "minLength", "maxLength"}, "a string", T_STRING);
        const bool lengths = s.contains("minLength") || s.contains("maxLength");
        const char * length_key = s.contains("minLength") ? "minLength" : "maxLength";
        if (s.contains("format")) {
            const json & f = s.at("format");
            if (!f.is_string() || !k_formats.count(f.get<std::string>())) {
                refuse(path, "format", (f.is_string() ? f.get<std::string>() : f.dump()) +
                       " is not one llama.cpp's converter writes (date, time, date-time, uuid, uuid1-uuid5)");
            }
        }
        if (s.contains("pattern")) {
            if (s.contains("format")) {
                refuse(path, "format", "beside pattern the converter writes the pattern alone");
            }
            if (lengths) {
                refuse(path, length_key, "beside pattern the converter writes the pattern alone");
            }
            if (s.at("pattern").is_string() && largest_repeat(s.at("pattern").get<std::string>()) > k_max_repeat) {
                refuse(path, "pattern", "repeats something more than " + std::to_string(k_max_repeat) +
                       " times, the most llama.cpp's grammar takes");
            }
            if (s.at("pattern").is_string() && !pattern_supported(s.at("pattern").get<std::string>())) {
                refuse(path, "pattern", s.at("pattern").get<std::string>() + " is not one llama.cpp's converter can "
                       "write (it needs ^...$ around a pattern without lookarounds, anchors inside or \\d-style classes)");
            }
            if (s.at("pattern").is_string()) {
                pattern_runnable(s.at("pattern").get<std::string>(), path);
            }
        } else if (s.contains("format") && lengths) {
            refuse(path, length_key, "beside format the converter writes the format alone");
        }
        const int64_t min_length = count(s, "minLength", path), max_length = count(s, "maxLength", path);
        if (max_length >= 0 && min_length > max_length) {
            refuse(path, "minLength", "above maxLength: no string is valid");
        }
    }

    // whether the converter writes the pattern (on an unsupported one it writes "any string" and
    // prints a warning): converted alone, a fallback leaves the any-string rule "string" behind,
    // and the builder is left by an exception before build_grammar prints its warning
    static bool pattern_supported(const std::string & pattern) {
        struct stop {};
        const common_chat_schema_document doc =
            common_chat_schema_from_json(json::object({{"type", "string"}, {"pattern", pattern}}));
        bool fell_back = false;
        try {
            build_grammar([&](const common_grammar_builder & b) {
                b.add_schema("root", *doc.root);
                // a rule named "string" with other content gets another name when "string" exists
                fell_back = b.add_rule("string", "\"probe\"") != "string";
                throw stop{};
            });
        } catch (const stop &) {
        }
        return !fell_back;
    }

    // a pattern the converter writes as a grammar llama.cpp's engine cannot run (a{3,1}, (a?)*,
    // ((a?){32}){32}: the grammar check's words, clover-grammar.cpp)
    static void pattern_runnable(const std::string & pattern, const std::string & path) {
        const std::string g = json_schema_to_grammar(json::object({{"type", "string"}, {"pattern", pattern}}), true);
        std::string       why;
        if (!clover_impl::grammar_check(g.c_str(), "root", nullptr, why)) {
            for (const char * noise : { "invalid grammar: ", "rule 'root': ", "rule 'root' ", " (root -> root)" }) {
                const size_t at = why.find(noise);  // (the pattern is all the grammar: its rule has no name to give)
                if (at != std::string::npos) {
                    why.erase(at, strlen(noise));
                }
            }
            refuse(path, "pattern", (pattern.size() > 80 ? pattern.substr(0, 80) + "..." : pattern) + ": " + why);
        }
    }

    static void integer(const json & s, const std::string & path) {
        only(s, path, {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}, "an integer", T_INTEGER);
        if (s.contains("minimum") && s.contains("exclusiveMinimum")) {
            refuse(path, "exclusiveMinimum", "beside minimum the converter reads minimum alone");
        }
        if (s.contains("maximum") && s.contains("exclusiveMaximum")) {
            refuse(path, "exclusiveMaximum", "beside maximum the converter reads maximum alone");
        }
        // the least and greatest integer each bound admits, as the converter rounds them
        const std::map<std::string, std::function<double(double)>> bounds = {
            {"minimum",          [](double b) { return std::ceil(b); }},
            {"exclusiveMinimum", [](double b) { return std::floor(b) + 1; }},
            {"maximum",          [](double b) { return std::floor(b); }},
            {"exclusiveMaximum", [](double b) { return std::ceil(b) - 1; }},
        };
        double lo = -k_max_bound, hi = k_max_bound;
        for (const auto & [key, admits] : bounds) {
            if (!s.contains(key) || !s.at(key).is_number()) {
                continue;  // absent, or the converter refuses it
            }
            const double b = s.at(key).get<double>();
            if (!(std::fabs(b) <= k_max_bound)) {
                refuse(path, key, "beyond +-1e15, the converter's integers have at most 16 digits");
            }
            (key.find("inimum") != std::string::npos ? lo : hi) = admits(b);
        }
        if (lo > hi) {
            refuse(path, "minimum", "no integer lies between the bounds");
        }
    }

    // allOf: the converter merges the properties of object components (all of them required) and
    // intersects enum components; any other component it passes over
    void all_of(const json & s, const std::string & path, int depth) {
        only(s, path, {"type", "allOf"}, "a schema with allOf (it reads the components alone)");
        const json & parts = s.at("allOf");
        if (!parts.is_array()) {
            return;
        }
        std::set<std::string> names, required;
        std::optional<std::map<std::string, size_t>> enum_counts;
        size_t n_objects = 0;
        for (size_t i = 0; i < parts.size(); i++) {
            const std::string at = path + "/allOf/" + std::to_string(i);
            const json & part = parts.at(i);
            const json * p = deref(part);
            if (!p || !p->is_object()) {
                continue;  // the converter refuses it
            }
            // {"required": [...]} alone: the converter passes over it, and every merged property is required
            bool only_required = p->contains("required") && p->at("required").is_array();
            for (const auto & [key, value] : p->items()) {
                (void) value;
                only_required = only_required && (key == "required" || k_annotations.count(key));
            }
            if (only_required) {
                const json & req = p->at("required");
                for (size_t j = 0; j < req.size(); j++) {
                    required.insert(req.at(j).is_string() ? req.at(j).get<std::string>() : req.at(j).dump());
                }
                continue;
            }
            visit(part, at, depth + 1);  // its own keywords, as a schema on its own
            if (p->contains("enum") && p->at("enum").is_array() && !p->contains("const")) {
                if (!enum_counts) {
                    enum_counts.emplace();
                }
                const json & values = p->at("enum");
                std::set<std::string> mine;
                for (size_t j = 0; j < values.size(); j++) {
                    mine.insert(values.at(j).dump());
                }
                for (const auto & v : mine) {
                    (*enum_counts)[v]++;
                }
                continue;
            }
            const bool is_object = (p->contains("properties") || (p->contains("additionalProperties") &&
                                    p->at("additionalProperties") != true) ||
                                    (p->contains("type") && p->at("type") == "object")) &&
                                   !p->contains("allOf") && !p->contains("anyOf") && !p->contains("oneOf");
            if (is_object) {
                n_objects++;
                if (p->contains("additionalProperties") && p->at("additionalProperties") != true) {
                    refuse(at, "additionalProperties", "inside allOf: the merged object takes no other properties, "
                           "and this one would judge the other components' properties");
                }
                if (p->contains("properties") && p->at("properties").is_object()) {
                    for (const auto & [name, prop] : p->at("properties").items()) {
                        (void) prop;
                        if (!names.insert(name).second) {
                            refuse(at, "properties", name + " is in two allOf components (the converter keeps one)");
                        }
                    }
                }
                continue;
            }
            refuse(at, "allOf", "the converter merges only object components (their properties) and enums");
        }
        if (enum_counts && n_objects) {
            refuse(path, "allOf", "the converter merges objects or intersects enums, not both at once");
        }
        if (enum_counts) {
            bool common = false;
            for (const auto & [v, n] : *enum_counts) {
                common = common || n == parts.size();
            }
            if (!common) {
                refuse(path, "allOf", "its enums have no value in common");
            }
        }
        for (const auto & name : required) {
            if (!names.count(name)) {
                refuse(path, "required", "names " + name + ", which no allOf component's properties define");
            }
        }
    }

    // the value types a schema admits (a superset: T_ALL where unsure)
    uint32_t types_of(const json & s, int depth) const {
        const json * p = depth < k_max_depth ? deref(s) : nullptr;
        if (!p || !p->is_object()) {
            return T_ALL;
        }
        for (const char * key : {"oneOf", "anyOf"}) {
            if (p->contains(key) && p->at(key).is_array()) {
                uint32_t bits = 0;
                for (size_t i = 0; i < p->at(key).size(); i++) {
                    bits |= types_of(p->at(key).at(i), depth + 1);
                }
                return bits;
            }
        }
        if (p->contains("const")) {
            return value_bits(p->at("const"));
        }
        if (p->contains("enum") && p->at("enum").is_array()) {
            uint32_t bits = 0;
            for (size_t i = 0; i < p->at("enum").size(); i++) {
                bits |= value_bits(p->at("enum").at(i));
            }
            return bits;
        }
        if (p->contains("type")) {
            const json & t = p->at("type");
            if (t.is_string()) {
                return type_bits(t.get<std::string>());
            }
            uint32_t bits = 0;
            for (size_t i = 0; t.is_array() && i < t.size(); i++) {
                bits |= t.at(i).is_string() ? type_bits(t.at(i).get<std::string>()) : T_ALL;
            }
            return bits;
        }
        if (p->contains("properties")) {
            return T_OBJECT;
        }
        if (p->contains("items") || p->contains("prefixItems")) {
            return T_ARRAY;
        }
        return T_ALL;
    }

    // the values a const / enum schema admits (dumped), nullopt for any other schema
    std::optional<std::set<std::string>> values_of(const json & s) const {
        const json * p = deref(s);
        if (!p || !p->is_object()) {
            return std::nullopt;
        }
        if (p->contains("const")) {
            return std::set<std::string>{ p->at("const").dump() };
        }
        if (p->contains("enum") && p->at("enum").is_array()) {
            std::set<std::string> out;
            for (size_t i = 0; i < p->at("enum").size(); i++) {
                out.insert(p->at("enum").at(i).dump());
            }
            return out;
        }
        return std::nullopt;
    }

    static bool disjoint(const std::set<std::string> & a, const std::set<std::string> & b) {
        for (const auto & v : a) {
            if (b.count(v)) {
                return false;
            }
        }
        return true;
    }

    // two alternatives no value matches both: constants apart, value types apart, or objects told
    // apart by a property both require with constants apart (a discriminator)
    bool exclusive(const json & a, const json & b) const {
        auto va = values_of(a), vb = values_of(b);
        if (va && vb) {
            return disjoint(*va, *vb);
        }
        if ((types_of(a, 0) & types_of(b, 0)) == 0) {
            return true;
        }
        const json * pa = deref(a);
        const json * pb = deref(b);
        if (!pa || !pb || !has(*pa, "properties") || !has(*pb, "properties") || !has(*pa, "required") || !has(*pb, "required")) {
            return false;
        }
        const json & req = pa->at("required");
        for (size_t i = 0; req.is_array() && i < req.size(); i++) {
            if (!req.at(i).is_string()) {
                continue;
            }
            const std::string name = req.at(i).get<std::string>();
            bool in_b = false;
            const json & req_b = pb->at("required");
            for (size_t j = 0; req_b.is_array() && j < req_b.size(); j++) {
                in_b = in_b || (req_b.at(j).is_string() && req_b.at(j).get<std::string>() == name);
            }
            if (!in_b || !pa->at("properties").is_object() || !pb->at("properties").is_object() ||
                !pa->at("properties").contains(name) || !pb->at("properties").contains(name)) {
                continue;
            }
            auto xa = values_of(pa->at("properties").at(name)), xb = values_of(pb->at("properties").at(name));
            if (xa && xb && disjoint(*xa, *xb)) {
                return true;
            }
        }
        return false;
    }

    // the converter writes oneOf as anyOf: a value matching two alternatives would be invalid
    void check_exclusive(const json & alts, const std::string & path) const {
        for (size_t i = 0; i < alts.size(); i++) {
            for (size_t j = i + 1; j < alts.size(); j++) {
                if (!exclusive(alts.at(i), alts.at(j))) {
                    refuse(path, "oneOf", "alternatives " + std::to_string(i) + " and " + std::to_string(j) +
                           " can match the same value, and the converter writes oneOf as anyOf (use anyOf, or tell "
                           "them apart by type or by a required property's const)");
                }
            }
        }
    }
};

// the converter's message ("JSON schema conversion failed:\nJSON schema error at #/x: ...") on one line
std::string one_line(std::string msg) {
    const std::string prefix = "JSON schema conversion failed:\n";
    if (msg.compare(0, prefix.size(), prefix) == 0) {
        msg = msg.substr(prefix.size());
    }
    for (auto & c : msg) {
        c = c == '\n' ? ';' : c;
    }
    return msg.compare(0, 11, "JSON schema") == 0 ? msg : "JSON schema: " + msg;
}

}  // namespace

int clover_json_schema_to_grammar(const char * schema_json, char * buf, int32_t buf_size, int32_t * n_out,
                                  char * err, size_t err_len) {
    using namespace clover_impl;
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (n_out) {
            *n_out = 0;
        }
        if (!schema_json) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "schema_json is NULL");
        }
        if (buf_size < 0 || (!buf && buf_size > 0)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "buf is NULL or buf_size is negative");
        }
        const json schema = json::parse_no_throw(schema_json);
        if (schema.is_discarded()) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "JSON schema: not valid JSON");
        }
        std::string grammar;
        try {
            keyword_check(schema).run();
            grammar = json_schema_to_grammar(schema, /* force_gbnf */ true);
        } catch (const schema_refusal & e) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, e.what());
        } catch (const std::invalid_argument & e) {  // the converter's refusals
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, one_line(e.what()));
        } catch (const std::runtime_error & e) {     // common_json_error: a keyword of the wrong JSON type
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, one_line(e.what()));
        }
        std::string why;
        if (!clover_impl::grammar_check(grammar.c_str(), "root", nullptr, why)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "JSON schema: its grammar: " + why);
        }
        if (grammar.size() > (size_t) std::numeric_limits<int32_t>::max() - 1) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "JSON schema: the grammar would exceed 2 GB");
        }
        if (n_out) {
            *n_out = (int32_t) grammar.size();
        }
        if ((size_t) buf_size < grammar.size() + 1) {
            return set_err(err, err_len, CLOVER_ERR_BUFFER_TOO_SMALL,
                           "the grammar needs " + std::to_string(grammar.size() + 1) + " bytes");
        }
        std::memcpy(buf, grammar.c_str(), grammar.size() + 1);
        return CLOVER_OK;
    });
}
