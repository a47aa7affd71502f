// fmt's compiled half, built once here. The headers alone (FMT_HEADER_ONLY) made every
// translation unit compile and optimize format-inl.h again: at -O3 that was most of the time of
// a small file (ir/status.cc: 4.5 s without it, 23 s with it) and about half the project's build.
// Linking Debian's libfmt.so instead would make the executables and the library that
// `kiln compile` ships need libfmt at run time (docs/aot.md); a static copy of the same
// definitions keeps them self-contained. These are the instantiations libfmt itself exports for
// the char and wchar_t paths of fmt 9 (format-inl.h defines the non-template functions).
#include <fmt/format-inl.h>

FMT_BEGIN_NAMESPACE
namespace detail {

template FMT_API auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template FMT_API auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;

template FMT_API locale_ref::locale_ref(const std::locale& loc);
template FMT_API auto locale_ref::get<std::locale>() const -> std::locale;

template FMT_API auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template FMT_API auto decimal_point_impl(locale_ref) -> char;
template FMT_API void buffer<char>::append(const char*, const char*);
template FMT_API void vformat_to(buffer<char>&, string_view, basic_format_args<FMT_BUFFER_CONTEXT(char)>,
                                 locale_ref);

template FMT_API auto thousands_sep_impl(locale_ref) -> thousands_sep_result<wchar_t>;
template FMT_API auto decimal_point_impl(locale_ref) -> wchar_t;
template FMT_API void buffer<wchar_t>::append(const wchar_t*, const wchar_t*);

}  // namespace detail
FMT_END_NAMESPACE
