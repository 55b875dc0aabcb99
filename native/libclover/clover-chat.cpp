// clover-chat.cpp - clover_chat_params / clover_chat_parse (clover-chat.h): llama.cpp's chat formats
// (common/chat.cpp) as llama-server runs them: the template tells which tool-call markup the model
// writes (Hermes/Qwen JSON, Qwen3-Coder XML, Llama 3.x, Mistral, ...), and its PEG parser reads a
// reply, whole or partial, into an OpenAI message.

#include "clover-chat.h"
#include "clover-impl.h"

#include "chat.h"
#include "json.h"
#include "log.h"

#include <stdexcept>
#include <string>

namespace {

using json = common_json;

thread_local std::string g_out;  // the last result on this thread (clover-chat.h: valid until the next call)

std::string one_line(std::string msg) {
    for (auto & c : msg) {
        c = (c == '\n' || c == '\r') ? ' ' : c;
    }
    return msg.size() > 400 ? msg.substr(0, 400) + "..." : msg;
}

template <typename T>
T field(const json & j, const char * key, T fallback) {
    return j.contains(key) && !j.at(key).is_null() ? j.at(key).get<T>() : fallback;
}

const char * trigger_type(common_grammar_trigger_type t) {
    switch (t) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:        return "token";
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:         return "word";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:      return "pattern";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: return "pattern_full";
    }
    return "unknown";
}

// tool_choice as chat.cpp takes it; a named function is that tool alone, required (as OpenAI means it)
common_chat_tool_choice tool_choice(const json & req, json & tools) {
    if (!req.contains("tool_choice") || req.at("tool_choice").is_null()) {
        return COMMON_CHAT_TOOL_CHOICE_AUTO;
    }
    const json & choice = req.at("tool_choice");
    if (choice.is_string()) {
        return common_chat_tool_choice_parse_oaicompat(choice.get<std::string>());
    }
    const std::string name = choice.at("function").at("name").get<std::string>();
    json named = json::array();
    for (size_t i = 0; tools.is_array() && i < tools.size(); i++) {
        const json & t = tools.at(i);
        if (t.contains("function") && t.at("function").contains("name") && t.at("function").at("name") == name) {
            named.push_back(t);
        }
    }
    if (named.empty()) {
        throw std::invalid_argument("tool_choice: no tool named '" + name + "'");
    }
    tools = named;
    return COMMON_CHAT_TOOL_CHOICE_REQUIRED;
}

json params_json(const json & req) {
    if (!req.is_object() || !req.contains("template") || !req.at("template").is_string()) {
        throw std::invalid_argument("the request needs \"template\", the chat template's Jinja source");
    }
    const auto tmpls = common_chat_templates_init(nullptr, req.at("template").get<std::string>(),
                                                  field<std::string>(req, "bos_token", ""),
                                                  field<std::string>(req, "eos_token", ""));
    json tools    = req.contains("tools") ? req.at("tools") : json();
    json messages = req.contains("messages") ? req.at("messages")
                                             : json::array({ json::object({ { "role", "user" }, { "content", "" } }) });
    common_chat_templates_inputs in;
    in.tool_choice         = tool_choice(req, tools);
    in.messages            = common_chat_msgs_parse_oaicompat(messages);
    in.tools               = common_chat_tools_parse_oaicompat(tools);
    in.parallel_tool_calls = field<bool>(req, "parallel_tool_calls", false);
    in.reasoning_format    = common_reasoning_format_from_name(field<std::string>(req, "reasoning_format", "none"));
    in.enable_thinking     = field<bool>(req, "enable_thinking", true);
    const common_chat_params p = common_chat_templates_apply(tmpls.get(), in);

    json triggers = json::array();
    for (const auto & t : p.grammar_triggers) {
        triggers.push_back(json::object({ { "type", trigger_type(t.type) }, { "value", t.value } }));
    }
    json out = json::object();
    out["format"]            = (int) p.format;
    out["format_name"]       = common_chat_format_name(p.format);
    out["parser"]            = p.parser;
    out["generation_prompt"] = p.generation_prompt;
    out["prompt"]            = p.prompt;
    out["grammar"]           = p.grammar;
    out["grammar_lazy"]      = p.grammar_lazy;
    out["grammar_triggers"]  = triggers;
    out["preserved_tokens"]  = p.preserved_tokens;
    out["additional_stops"]  = p.additional_stops;
    return out;
}

common_chat_parser_params parser_params(const json & req) {
    const int format = field<int>(req, "format", (int) COMMON_CHAT_FORMAT_CONTENT_ONLY);
    if (format < 0 || format >= (int) COMMON_CHAT_FORMAT_COUNT) {
        throw std::invalid_argument("format " + std::to_string(format) + " is not one of chat.cpp's");
    }
    common_chat_parser_params pp;
    pp.format            = (common_chat_format) format;
    pp.generation_prompt = field<std::string>(req, "generation_prompt", "");
    const std::string parser = field<std::string>(req, "parser", "");
    if (!parser.empty()) {
        pp.parser.load(parser);
    }
    return pp;
}

json message_json(const std::string & text, bool is_partial, const common_chat_parser_params & pp) {
    const common_chat_msg msg = common_chat_parse(text, is_partial, pp);
    json calls = json::array();
    for (const auto & c : msg.tool_calls) {
        calls.push_back(json::object({ { "name", c.name }, { "arguments", c.arguments }, { "id", c.id } }));
    }
    json out = json::object();
    out["role"]              = "assistant";
    out["content"]           = msg.content;
    out["reasoning_content"] = msg.reasoning_content;
    out["tool_calls"]        = calls;
    return out;
}

json parse_json(const json & req) {
    if (!req.is_object() || !req.contains("text") || !req.at("text").is_string()) {
        throw std::invalid_argument("the request needs \"text\", the generated reply");
    }
    return message_json(req.at("text").get<std::string>(), field<bool>(req, "is_partial", false), parser_params(req));
}

// chat.cpp logs through common/log's logger (stderr), not llama_log_set's callback: its lines show
// at libclover's debug verbosity only (a refused reply is our error status; the caller reads it
// another way). Written only when the verbosity changes (the threshold is a plain int).
void quiet_common_log() {
    const int thold = clover_impl::g_verbosity.load() >= 2 ? LOG_LEVEL_DEBUG : LOG_LEVEL_OUTPUT - 1;
    if (common_log_get_verbosity_thold() != thold) {
        common_log_set_verbosity_thold(thold);
    }
}

// the request parsed, f's answer dumped into g_out; every exception a one-line CLOVER_ERR_INVALID_ARG
// (what chat.cpp throws is about its input: the template, the messages, a reply off the format)
template <typename F>
int json_call(const char * request_json, const char ** out, char * err, size_t err_len, F && f) {
    using namespace clover_impl;
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        quiet_common_log();
        if (out) {
            *out = nullptr;
        }
        if (!request_json || !out) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "request_json or out is NULL");
        }
        const json req = json::parse_no_throw(request_json);
        if (req.is_discarded()) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "the request is not valid JSON");
        }
        try {
            g_out = f(req).dump_safe();
        } catch (const std::bad_alloc &) {
            throw;
        } catch (const std::exception & e) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, one_line(e.what()));
        }
        *out = g_out.c_str();
        return CLOVER_OK;
    });
}

}  // namespace

int clover_chat_params(const char * request_json, const char ** out, char * err, size_t err_len) {
    return json_call(request_json, out, err, err_len, params_json);
}

int clover_chat_parse(const char * request_json, const char ** out, char * err, size_t err_len) {
    return json_call(request_json, out, err, err_len, parse_json);
}

struct clover_chat_parser {
    common_chat_parser_params params;
    std::string               out;  // the last parse (clover-chat.h: valid until the next call)
};

int clover_chat_parser_new(const char * params_json, clover_chat_parser ** out, char * err, size_t err_len) {
    if (out) {
        *out = nullptr;
    }
    const char * ignored = nullptr;
    return json_call(params_json, &ignored, err, err_len, [&](const json & req) {
        if (!out) {
            throw std::invalid_argument("out is NULL");
        }
        *out = new clover_chat_parser{ parser_params(req), "" };
        return json::object();
    });
}

int clover_chat_parser_parse(clover_chat_parser * parser, const char * text, int is_partial, const char ** out,
                             char * err, size_t err_len) {
    using namespace clover_impl;
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        quiet_common_log();
        if (out) {
            *out = nullptr;
        }
        if (!parser || !text || !out) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "parser, text or out is NULL");
        }
        try {
            parser->out = message_json(text, is_partial != 0, parser->params)
                              .dump_safe();
        } catch (const std::bad_alloc &) {
            throw;
        } catch (const std::exception & e) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, one_line(e.what()));
        }
        *out = parser->out.c_str();
        return CLOVER_OK;
    });
}

void clover_chat_parser_free(clover_chat_parser * parser) {
    delete parser;
}
