# The tensor checksum of device memory, in th_cuda: the kernel and its host side (checksum.cu), the
# batch layout (checksum_blocks.cpp) and the XXH3 secret (xxh3_parts.cpp). Included by
# client/cuda/CMakeLists.txt when TH_HAVE_CUDA. checksum.cu calls client_impl::checksum_of_digests
# (client/checksum.cpp), which libthclient defines; another user of th_cuda (the GPU test in
# tests/gpu/checksum.cmake) compiles that file itself.
target_sources(th_cuda PRIVATE ${CMAKE_CURRENT_LIST_DIR}/checksum.cu ${CMAKE_CURRENT_LIST_DIR}/checksum_blocks.cpp
                               ${CMAKE_CURRENT_LIST_DIR}/xxh3_parts.cpp)
