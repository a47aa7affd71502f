#include <cstdio>
#include "ir/op_def.h"
int main() { std::printf("%zu ops\n", kiln::ir::OpRegistry::get().all().size()); }
