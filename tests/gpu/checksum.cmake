# The tensor checksum (client/checksum.h) and its GPU form (client/cuda/checksum.cu), issue 15.
# Included by tests/gpu/CMakeLists.txt.

# CPU only, built and run everywhere (label cuda): XXH3's long path as the kernel composes it
# (client/cuda/xxh3_parts.h, compiled by g++) against libxxhash, the blocked checksum against its
# definition, and the GPU path's layout on host memory. It needs no CUDA: not th_cuda, only these
# sources, the checksum's objects and xxhash.
th_add_test(gpu_checksum_parts_test cuda
            SOURCES ${CMAKE_CURRENT_LIST_DIR}/checksum_parts_test.cpp
                    ${PROJECT_SOURCE_DIR}/client/cuda/xxh3_parts.cpp ${PROJECT_SOURCE_DIR}/client/cuda/checksum_blocks.cpp
            LIBS th_checksum ${XXHASH_LIBRARY})
target_include_directories(gpu_checksum_parts_test PRIVATE ${PROJECT_SOURCE_DIR} ${XXHASH_INCLUDE_DIR})

# On a GPU (label gpu): one CTest test for the whole binary, since listing its GoogleTest cases
# would run it, and exit 77 (skipped) wherever there is no device. th_checksum provides
# checksum_of_digests, which th_cuda takes from libthclient in the library.
if(TH_HAVE_CUDA)
  add_executable(gpu_checksum_test ${CMAKE_CURRENT_LIST_DIR}/gpu_checksum_test.cpp)
  target_link_libraries(gpu_checksum_test PRIVATE th_checksum th_cuda GTest::gtest th_warnings)
  add_test(NAME gpu_checksum_test COMMAND gpu_checksum_test)
  set_tests_properties(gpu_checksum_test PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()
