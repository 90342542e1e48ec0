#pragma once
/// \file version.hpp
/// The library version (kept equal to the CMake project version by a test).

#define ATTN_VERSION_MAJOR 0
#define ATTN_VERSION_MINOR 1
#define ATTN_VERSION_PATCH 0
