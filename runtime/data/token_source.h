// Token streams for language models: a source yields windows of T+1 consecutive tokens, of
// which a batch takes tokens = window[0:T] and targets = window[1:T+1]. Sources: token files
// (flat little-endian u16 or u32 ids, nanoGPT's train.bin) and a seeded Markov chain
// (markov_tokens.h). Positions are StreamPositions, so checkpoints resume token streams exactly
// as they resume Criteo streams.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/data/batch.h"

namespace kiln::data {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Tokens per window: T + 1.
  virtual int64_t windowLength() const = 0;
  // Reads the next window into `window` (windowLength() ids); false at the end of the data.
  virtual Expected<bool> next(int32_t* window) = 0;
  // Continues from `pos` (its file and offset, or its sample for a synthetic stream; the
  // epoch is the caller's).
  virtual Status seek(const StreamPosition& pos) = 0;
  // Where the next window starts (epoch left 0).
  virtual StreamPosition position() const = 0;
};

enum class TokenDType : uint8_t { U16, U32 };

inline int tokenBytes(TokenDType t) { return t == TokenDType::U16 ? 2 : 4; }
std::string_view tokenDTypeName(TokenDType t);

// The dtype of a token file: `flag` ("u16" or "u32") when given, else by the name:
// `*.u32` and `*.u32.bin` hold u32 ids, `*.u16`, `*.u16.bin` and `*.bin` u16 (nanoGPT's).
Expected<TokenDType> tokenDTypeFor(const std::string& path, const std::string& flag);

// Token files read in order as one stream (no window crosses a gap: the files are concatenated).
// Windows are taken at stride T, so consecutive windows overlap in one token and every token
// after the first is a target exactly once; a last window shorter than T + 1 tokens is dropped.
// Files are streamed through a 1 MiB buffer. Opening checks every file (it opens, is no directory
// nor compressed, and holds whole tokens); ids >= vocab are errors naming the file and the token.
Expected<std::unique_ptr<TokenSource>> openTokenFiles(std::vector<std::string> files, TokenDType dtype,
                                                      int64_t seq_len, int64_t vocab);

// Fills `batch` (tokens and targets of `spec`, which reads tokens) from `n` windows stored back to
// back in `windows` (n * (T + 1) ids).
void assembleTokenBatch(const BatchSpec& spec, const int32_t* windows, int64_t n, Batch& batch);

}  // namespace kiln::data
