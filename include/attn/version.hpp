#pragma once
/// \file version.hpp
/// The library version (kept equal to the CMake project version by a test).

/// The major number of the version.
#define ATTN_VERSION_MAJOR 0
/// The minor number of the version.
#define ATTN_VERSION_MINOR 1
/// The patch number of the version.
#define ATTN_VERSION_PATCH 0
