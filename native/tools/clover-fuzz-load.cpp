// clover-fuzz-load: the GGUF loader as a fuzz target. Built as a plain driver (files or folders
// of files on the command line, each loaded and run for two tokens, for AFL-style fuzzers and
// for replaying a corpus under the sanitizers); with -DCLOVER_LIBFUZZER=ON (clang) it is a
// libFuzzer target instead. Every input must give a clean error or a result, never a crash.
#include "clover.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    // the loader reads a path (mmap), so the bytes go to a private temporary file
    char path[] = "/tmp/clover-fuzz-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) {
        return 0;
    }
    const bool ok = write(fd, data, size) == (ssize_t) size;
    close(fd);
    char err[512];
    clover_model * m = ok ? clover_model_load(path, nullptr, err, sizeof(err)) : nullptr;
    if (m) {
        clover_context_params cp = clover_context_default_params();
        cp.n_ctx = 64;
        cp.n_threads = 1;
        cp.block_size = 4;
        clover_context * c = clover_context_new(m, &cp, err, sizeof(err));
        if (c) {
            clover_generate_params gp = clover_generate_default_params();
            gp.max_tokens = 2;
            const int32_t prompt[1] = {0};
            int32_t out[2], n_out = 0;
            clover_generate(c, prompt, 1, &gp, out, 2, &n_out, nullptr, err, sizeof(err));
            clover_context_free(c);
        }
        clover_model_free(m);
    }
    unlink(path);
    return 0;
}

#ifndef CLOVER_LIBFUZZER
int main(int argc, char ** argv) {
    size_t n = 0;
    for (int i = 1; i < argc; ++i) {
        std::vector<std::filesystem::path> files;
        if (std::filesystem::is_directory(argv[i])) {
            for (const auto & e : std::filesystem::directory_iterator(argv[i])) {
                files.push_back(e.path());
            }
        } else {
            files.emplace_back(argv[i]);
        }
        for (const auto & f : files) {
            std::ifstream in(f, std::ios::binary);
            std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
            LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
            ++n;
        }
    }
    printf("clover-fuzz-load: %zu inputs, no crash\n", n);
    return 0;
}
#endif
