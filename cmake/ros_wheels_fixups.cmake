# Fix-ups for building against the ROS 2 wheels from PyPI.
#
# Passed as -DCMAKE_PROJECT_INCLUDE=<this file> by the Makefile, and only when
# the ROS wheels are used (never for an installed ROS 2).
#
# The wheels export imported targets <pkg>::<pkg>__rosidl_generator_py whose
# INTERFACE_INCLUDE_DIRECTORIES name the Python and numpy include directories
# of the machine that built the wheels (/opt/python/cp311-cp311/...). CMake
# refuses imported targets with non-existent include paths. At the end of
# configuration this replaces them with this interpreter's include directory
# and numpy's.
#
# The package's own <project>__rosidl_generator_py target gets the same
# directories as PUBLIC include paths. With the venv inside the source tree
# (.venv), CMake refuses to export source-tree paths, so those are wrapped
# in $<BUILD_INTERFACE:...> (nothing outside the build needs them).

cmake_minimum_required(VERSION 3.19)  # cmake_language(DEFER)

function(_flashrt_fix_rosidl_py_targets)
  if(DEFINED Python3_EXECUTABLE)
    set(_python "${Python3_EXECUTABLE}")
  else()
    find_program(_python NAMES python3 python REQUIRED)
  endif()
  execute_process(
    COMMAND "${_python}" -c
      "import sysconfig, numpy; print(sysconfig.get_paths()['include']); print(numpy.get_include())"
    OUTPUT_VARIABLE _out
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _rc
  )
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "ros_wheels_fixups: ${_python} could not report its include and numpy include dirs")
  endif()
  string(REPLACE "\n" ";" _includes "${_out}")

  get_property(_targets DIRECTORY "${CMAKE_SOURCE_DIR}" PROPERTY IMPORTED_TARGETS)
  set(_fixed 0)
  foreach(_target IN LISTS _targets)
    if(NOT _target MATCHES "__rosidl_generator_py$")
      continue()
    endif()
    get_target_property(_dirs ${_target} INTERFACE_INCLUDE_DIRECTORIES)
    if(NOT _dirs)
      continue()
    endif()
    # Keep the paths that exist here, drop the baked ones, add ours.
    set(_new "")
    foreach(_dir IN LISTS _dirs)
      if(EXISTS "${_dir}")
        list(APPEND _new "${_dir}")
      endif()
    endforeach()
    list(APPEND _new ${_includes})
    list(REMOVE_DUPLICATES _new)
    set_target_properties(${_target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_new}")
    math(EXPR _fixed "${_fixed} + 1")
  endforeach()
  message(STATUS "ros_wheels_fixups: include dirs of ${_fixed} rosidl_generator_py targets set to ${_includes}")

  get_property(_own DIRECTORY "${CMAKE_SOURCE_DIR}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(_target IN LISTS _own)
    if(NOT _target MATCHES "__rosidl_generator_py$")
      continue()
    endif()
    get_target_property(_dirs ${_target} INTERFACE_INCLUDE_DIRECTORIES)
    if(NOT _dirs)
      continue()
    endif()
    set(_new "")
    foreach(_dir IN LISTS _dirs)
      string(FIND "${_dir}/" "${CMAKE_SOURCE_DIR}/" _at)
      if(_at EQUAL 0)
        list(APPEND _new "$<BUILD_INTERFACE:${_dir}>")
      else()
        list(APPEND _new "${_dir}")
      endif()
    endforeach()
    set_target_properties(${_target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_new}")
  endforeach()
endfunction()

# Only the top-level project; CMAKE_PROJECT_INCLUDE runs after every project().
if(CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)
  cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _flashrt_fix_rosidl_py_targets)
endif()
