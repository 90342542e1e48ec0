# Conformance suites against other implementations' reference data, in an executable of their own
# (label `conformance`): `ctest -L conformance`.
#
# attn_conformance: the 87 ONNX Attention cases of tests/data/onnx_attention (opsets 23 to 25,
# computed by the ONNX reference implementation; see the README there) through
# attn::onnx::attention, in float and double.
add_executable(attn_conformance onnx_test.cpp)
target_link_libraries(attn_conformance PRIVATE
  attn::attn GTest::gtest_main nlohmann_json::nlohmann_json)
target_compile_definitions(attn_conformance PRIVATE
  ATTN_ONNX_CASES_DIR="${CMAKE_CURRENT_SOURCE_DIR}/data/onnx_attention")
attn_own_program(attn_conformance)
gtest_discover_tests(attn_conformance DISCOVERY_TIMEOUT 60
                     PROPERTIES LABELS conformance ENVIRONMENT OMP_WAIT_POLICY=passive)
