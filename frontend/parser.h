// A recursive-descent parser for .kiln files. On a syntax error it reports a located
// diagnostic, skips to the end of the statement, and goes on, so one run reports every
// independent mistake.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "frontend/ast.h"
#include "frontend/diagnostics.h"
#include "frontend/lexer.h"

namespace kiln::frontend {

// Parses a whole file. Always returns a tree; check diags.hasErrors().
std::unique_ptr<ast::File> parseFile(const std::string& path, std::string_view text, DiagnosticEngine& diags);

// Parses one expression (a `--set` value); nullptr after reporting an error.
ast::ExprPtr parseExpression(const std::string& origin, std::string_view text, DiagnosticEngine& diags);

}  // namespace kiln::frontend
