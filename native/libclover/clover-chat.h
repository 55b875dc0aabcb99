/* clover-chat.h - llama.cpp's chat formats (common/chat.cpp, what llama-server runs) in libclover:
 * which tool-call markup a chat template uses, and a generated reply parsed into an OpenAI message.
 *
 * JSON in, JSON out. Each function returns a clover_status (clover.h); on CLOVER_OK *out points at
 * NUL-terminated JSON that stays valid until the next call of either function on the same thread;
 * otherwise err (if not NULL) holds a one-line message. No C++ exception crosses these functions.
 * chat.cpp's own log lines (a reply off the format: "unparsed ... output") are shown only at
 * clover_set_verbosity 2 (debug): a refused reply is an error status, not a warning on stderr. */
#ifndef CLOVER_CHAT_H
#define CLOVER_CHAT_H

#include "clover.h"

#ifdef __cplusplus
extern "C" {
#endif

/* request_json: {"template": Jinja source (required), "bos_token": "", "eos_token": "",
 *   "messages": OpenAI messages (default: one empty user turn), "tools": OpenAI tools,
 *   "tool_choice": "auto" | "required" | "none" | {"type": "function", "function": {"name": N}} (named: that
 *   tool alone, required), "parallel_tool_calls": false, "reasoning_format": "none" (or "auto", "deepseek"),
 *   "enable_thinking": true}.
 * *out: {"format": int, "format_name", "parser" (the serialized PEG parser clover_chat_parse takes),
 *   "generation_prompt", "prompt" (llama.cpp's rendering), "grammar", "grammar_lazy",
 *   "grammar_triggers": [{"type": "token" | "word" | "pattern" | "pattern_full", "value"}],
 *   "preserved_tokens": [...], "additional_stops": [...]}. */
CLOVER_API int clover_chat_params(const char * request_json, const char ** out, char * err, size_t err_len);

/* request_json: {"format", "parser", "generation_prompt" as clover_chat_params gave them, "text": the
 * generated reply (without the generation prompt), "is_partial": false}. *out: {"role": "assistant",
 * "content", "reasoning_content", "tool_calls": [{"name", "arguments" (JSON text), "id"}]}; a partial
 * text gives the calls parsed so far (the last one's arguments may be cut off). A whole text that does
 * not match the format: CLOVER_ERR_INVALID_ARG. */
CLOVER_API int clover_chat_parse(const char * request_json, const char ** out, char * err, size_t err_len);

/* A reply's parser loaded once (clover_chat_parse loads the serialized parser at every call): a
 * streamed reply is parsed again whole at each piece, as llama-server does, from the one handle.
 * params_json: {"format", "parser", "generation_prompt"} as clover_chat_params gave them. */
typedef struct clover_chat_parser clover_chat_parser;
CLOVER_API int clover_chat_parser_new(const char * params_json, clover_chat_parser ** out, char * err, size_t err_len);
/* text (the reply so far, NUL-terminated UTF-8) parsed as clover_chat_parse does; *out valid until the
 * next call on the same parser or its free. */
CLOVER_API int clover_chat_parser_parse(clover_chat_parser * parser, const char * text, int is_partial,
                                        const char ** out, char * err, size_t err_len);
CLOVER_API void clover_chat_parser_free(clover_chat_parser * parser);

#ifdef __cplusplus
}
#endif

#endif /* CLOVER_CHAT_H */
